"""Triton kernels for the denoising steps' decoder layers (``FastPiSampler(step_layers="triton")``,
:mod:`agents.policies.pi0.fast_step_layers`).

A denoising step's GEMMs have few rows (PI0: 51 per observation) and read the expert's weights
once per step, so their time is set by the number of kernels and by how fast each reads its
weights, not by arithmetic. Unfused, a Gemma layer-step runs its four projection GEMMs (q/k/v and
gate/up stacked) through cuBLAS and, between them, inductor's kernels for the RMS norms, the rotary
embedding, the copy of the keys/values, gelu x up and the residual adds. Here three kinds of
kernel do all of it, each a GEMM over weights prepared once (``fast_step_layers``):

- :func:`qkv_rope`: the input RMS norm (its weight folded into the stacked q/k/v weights; the
  row's ``rsqrt(mean(x^2) + eps)`` accumulated in the same loop over the row that feeds the
  GEMM and applied to the product), the q/k/v projection and the rotary embedding. Each block
  computes columns ``d`` and ``d + D/2`` of one head together (the two halves that rotary mixes)
  and writes q as [B, H, S, D] (what attention reads) and k, v into the first S rows of the
  step's key/value buffers, in place;
- :func:`gate_up`: the post-attention RMS norm (folded the same way), the gate and up
  projections (columns ``n`` of both in one block) and ``gelu_tanh(gate) * up``;
- :func:`linear_residual`: a projection plus the residual (``o_proj``, reading attention's
  output in the [B, H, S, D] layout its GEMM wrote, and ``down_proj``).

Each is a ``torch.library.triton_op``: eager it launches its kernel, and under ``torch.compile``
inductor places the kernel in its generated code, so CUDA graphs capture it. On a CPU they run
only under Triton's interpreter (``TRITON_INTERPRET=1``: the tests). Tiles come from
:data:`TILES`, overridable per kernel for tuning on a new GPU (``TANDEM_PI0_STEP_TILES``).

Arithmetic: products accumulate in float32 and round once to the output dtype; lerobot rounds the
normed input, each projection and the rotary product to bf16 on the way. The results agree within
bf16 round-off, not bit for bit; on a CPU in float32, to float32 round-off.
"""

from __future__ import annotations

import json
import os

import torch

#: per kernel: rows per block, columns per block (of each of the pair), reduction step, warps,
#: pipeline stages; ``<kernel>`` for calls of at most ``ONE_OBSERVATION_ROWS`` rows (batch 1, where
#: reading the weights is the cost), ``<kernel>@batch`` for more (the arithmetic grows).
#: ``TANDEM_PI0_STEP_TILES`` (JSON, e.g. ``{"qkv": [64, 16, 128, 4, 3]}``) overrides some of them.
TILES = {"qkv": (64, 16, 128, 4, 3), "gate_up": (64, 32, 128, 4, 3), "residual": (64, 16, 128, 4, 3),
         "qkv@batch": (64, 32, 128, 4, 3), "gate_up@batch": (64, 64, 128, 4, 3), "residual@batch": (64, 32, 128, 4, 3)}
#: the rows up to which a call uses the batch-1 tiles. Compiled, batch 1 has a graph of its own
#: and the batch is at least 2 in the dynamic one (PI0: 102 rows and up), so the choice adds no guard
ONE_OBSERVATION_ROWS = 64
TILES.update({k: tuple(v) for k, v in json.loads(os.environ.get("TANDEM_PI0_STEP_TILES", "{}")).items()})

try:  # triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch build without triton
    triton = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on ``device`` (a GPU, or Triton's interpreter)."""
    return triton is not None and (torch.device(device).type == "cuda" or interpreted())


def _launcher(kernel):
    """Inductor wraps the kernel (``wrap_triton``); Triton's interpreter makes no JIT function to
    wrap, so there it is launched as is."""
    if interpreted():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _rows(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each 2-D tensor with unit stride along its rows (what the kernels' indexing assumes)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _ada(x: torch.Tensor, mod: torch.Tensor | None, bias: torch.Tensor | None):
    """(whether AdaRMS applies, the modulation row and the shift bias as flat contiguous vectors;
    x in their place where it does not)."""
    if (mod is None) != (bias is None):
        raise ValueError("the step kernels take an AdaRMS modulation and its shift bias together")
    if mod is None:
        return False, x, x
    return True, mod.reshape(-1).contiguous(), bias.reshape(-1).contiguous()


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


if triton is not None:

    @triton.jit
    def _dots(X, W, xrow, row_ok, ca, cb, col_ok, K, sxh, swn, Mod, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, XD: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr, ADA: tl.constexpr):
        """``X[rows] @ W[ca]^T`` (and ``W[cb]^T`` with PAIR) over the whole reduction, float32
        accumulators [BM, BN]; with NORM also each row's sum of squares (the RMS norm's). Row
        ``i`` of X starts at ``xrow[i]``; XD = 0: its columns are contiguous; XD > 0: X is
        attention's output [B, H, S, XD], a row's column ``k`` is head ``k // XD`` (``sxh``
        apart), lane ``k % XD``. ADA: X's columns scaled by ``1 + Mod[k]`` (AdaRMS's scale) after
        the sum of squares and before the product."""
        acc_a = tl.zeros([BM, BN], dtype=tl.float32)
        acc_b = tl.zeros([BM, BN], dtype=tl.float32)
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < K
            if XD > 0:
                xk = (kk // XD) * sxh + kk % XD
            else:
                xk = kk
            x = tl.load(X + xrow[:, None] + xk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            if ADA:
                pre = 1.0 + tl.load(Mod + kk, mask=k_ok, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * pre[None, :]).to(X.dtype.element_ty)
            w = tl.load(W + ca[None, :] * swn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_a = tl.dot(x, w, acc_a)
            if PAIR:
                w2 = tl.load(W + cb[None, :] * swn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_b = tl.dot(x, w2, acc_b)
        return acc_a, acc_b, ss

    @triton.jit
    def _normed_pair(acc_a, acc_b, ss, K, eps, Bias, ca, cb, col_ok, ADA: tl.constexpr):
        """The pair of products of the row-normed input: scaled by each row's inverse RMS (from
        its sum of squares ``ss`` over K), with ADA the shift's bias at columns ``ca`` / ``cb``."""
        r = 1.0 / tl.sqrt(ss / K + eps)
        a = acc_a * r[:, None]
        b = acc_b * r[:, None]
        if ADA:
            a += tl.load(Bias + ca, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            b += tl.load(Bias + cb, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return a, b

    @triton.jit
    def _qkv_kernel(X, W, Cos, Sin, Q, Kb, Vb, Mod, Bias, M, S, K, H, HKV, eps, sxm, swn, scm, skb, skh, skn, svb,
                    svh, svn, D: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, ADA: tl.constexpr):
        """Block (pid 0: head x half-block, pid 1: rows): columns ``d`` and ``d + HALF`` of one
        head of the normed q/k/v projection, rotated (q and k heads), stored per head: q in Q
        [B, H, S, D], k and v in the first S rows of the buffers Kb, Vb [B, HKV, >= S, D]. ADA
        (PI0.5): the norm's scale from Mod, its shift through ``Bias`` (shift @ W^T)."""
        blocks = tl.cdiv(HALF, BN)
        head = tl.program_id(0) // blocks
        d = (tl.program_id(0) % blocks) * BN + tl.arange(0, BN)
        d_ok = d < HALF
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        row_ok = rows < M
        ca = head * D + d
        acc_a, acc_b, ss = _dots(X, W, rows * sxm, row_ok, ca, ca + HALF, d_ok, K, 0, swn, Mod, BM, BN, BK, 0,
                                 True, True, ADA)
        a, b = _normed_pair(acc_a, acc_b, ss, K, eps, Bias, ca, ca + HALF, d_ok, ADA)
        ok = row_ok[:, None] & d_ok[None, :]
        if head < H + HKV:  # rotary: x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1)
            cs = Cos + rows[:, None] * scm + d[None, :]
            sn = Sin + rows[:, None] * scm + d[None, :]
            cos_a = tl.load(cs, mask=ok, other=0.0).to(tl.float32)
            cos_b = tl.load(cs + HALF, mask=ok, other=0.0).to(tl.float32)
            sin_a = tl.load(sn, mask=ok, other=0.0).to(tl.float32)
            sin_b = tl.load(sn + HALF, mask=ok, other=0.0).to(tl.float32)
            a, b = a * cos_a - b * sin_a, b * cos_b + a * sin_b
        bi = rows // S
        si = rows % S
        # three predicated stores, not a pointer chosen by branch: inductor's analysis of which
        # arguments a kernel writes follows each store to its argument (q, then the buffers)
        a = a.to(Q.dtype.element_ty)
        b = b.to(Q.dtype.element_ty)
        hq = tl.minimum(head, H - 1)
        hk = tl.minimum(tl.maximum(head - H, 0), HKV - 1)
        hv = tl.minimum(tl.maximum(head - H - HKV, 0), HKV - 1)
        qp = Q + (((bi * H + hq) * S + si) * D)[:, None] + d[None, :]  # q: [B, H, S, D]
        kp = Kb + (bi * skb + hk * skh + si * skn)[:, None] + d[None, :]  # k, v: rows 0..S-1 of the buffers
        vp = Vb + (bi * svb + hv * svh + si * svn)[:, None] + d[None, :]
        is_q, is_k, is_v = head < H, (head >= H) & (head < H + HKV), head >= H + HKV
        tl.store(qp, a, mask=ok & is_q)
        tl.store(qp + HALF, b, mask=ok & is_q)
        tl.store(kp, a, mask=ok & is_k)
        tl.store(kp + HALF, b, mask=ok & is_k)
        tl.store(vp, a, mask=ok & is_v)
        tl.store(vp + HALF, b, mask=ok & is_v)

    @triton.jit
    def _gate_up_kernel(X, W, Out, Mod, Bias, M, N, K, eps, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, ADA: tl.constexpr):
        """Columns ``n`` of gelu_tanh(normed x @ gate^T) * (normed x @ up^T); W is [gate; up].
        ADA as in :func:`_qkv_kernel`."""
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        col_ok = cols < N
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        row_ok = rows < M
        acc_g, acc_u, ss = _dots(X, W, rows * sxm, row_ok, cols, cols + N, col_ok, K, 0, swn, Mod, BM, BN, BK, 0,
                                 True, True, ADA)
        g, u = _normed_pair(acc_g, acc_u, ss, K, eps, Bias, cols, cols + N, col_ok, ADA)
        # gelu's tanh form: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        act = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        tl.store(Out + rows[:, None] * som + cols[None, :], (act * u).to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _residual_kernel(X, W, Res, Out, Gate, M, N, K, S, XH, sxm, swn, srm, som, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, XD: tl.constexpr, GATED: tl.constexpr):
        """Columns ``n`` of Res + X @ W^T (GATED: Res + (X @ W^T) * Gate[n]); X [M, K] (XD = 0)
        or attention's [B, XH, S, XD]."""
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        col_ok = cols < N
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        row_ok = rows < M
        if XD > 0:
            xrow = ((rows // S) * XH * S + rows % S) * XD
        else:
            xrow = rows * sxm
        acc, _, _ = _dots(X, W, xrow, row_ok, cols, cols, col_ok, K, S * XD, swn, X, BM, BN, BK, XD, False, False,
                          False)
        if GATED:
            acc *= tl.load(Gate + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        res = tl.load(Res + rows[:, None] * srm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + rows[:, None] * som + cols[None, :], (acc + res).to(Out.dtype.element_ty), mask=ok)

    def _tiles(name: str, m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
        bm, bn, bk, warps, stages = TILES[name if m <= ONE_OBSERVATION_ROWS else f"{name}@batch"]
        return bm, min(bn, _pow2(n)), min(bk, _pow2(k)), warps, stages

    @torch.library.triton_op("tandem::pi0_step_qkv", mutates_args=("kbuf", "vbuf"))
    def qkv_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kbuf: torch.Tensor,
                 vbuf: torch.Tensor, seq: int, heads: int, eps: float, mod: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [B * seq, width] (rows contiguous), w [(heads + 2 Hkv) * D, width] (q, k, v stacked,
        the norm's ``1 + weight`` folded in), cos / sin [B * seq, D], the step buffers kbuf / vbuf
        [B, Hkv, >= seq, D] (last dimension contiguous) -> q [B, heads, seq, D] in x's dtype: the
        normed projection, q and k rotated; k and v written into the buffers' first ``seq`` rows.
        PI0.5's AdaRMS norm: ``mod`` its modulation row (scale, shift, gate; the scale is read)
        and ``bias`` its shift through w (``shift @ w^T``, [N]), both or neither."""
        x, w, cos, sin = _rows(x, w, cos, sin)
        ada, mod, bias = _ada(x, mod, bias)
        if kbuf.stride(-1) != 1 or vbuf.stride(-1) != 1:
            raise ValueError("qkv_rope: the key/value buffers need a contiguous last dimension")
        m, k = x.shape
        d, kv_heads = cos.shape[-1], kbuf.shape[1]
        q = x.new_empty(m // seq, heads, seq, d)
        bm, bn, bk, warps, stages = _tiles("qkv", m, d // 2, k)
        grid = ((heads + 2 * kv_heads) * triton.cdiv(d // 2, bn), triton.cdiv(m, bm))
        _launcher(_qkv_kernel)[grid](x, w, cos, sin, q, kbuf, vbuf, mod, bias, m, seq, k, heads, kv_heads, eps,
                                     x.stride(0), w.stride(0), cos.stride(0), kbuf.stride(0), kbuf.stride(1),
                                     kbuf.stride(2), vbuf.stride(0), vbuf.stride(1), vbuf.stride(2), D=d, HALF=d // 2,
                                     BM=bm, BN=bn, BK=bk, ADA=ada, num_warps=warps, num_stages=stages)
        return q

    @torch.library.triton_op("tandem::pi0_step_gate_up", mutates_args=())
    def gate_up(x: torch.Tensor, w: torch.Tensor, eps: float, mod: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, width], w [2 N, width] (gate then up, the norm's ``1 + weight`` folded in) ->
        gelu_tanh(gate) * up [M, N] of the normed x; ``mod``, ``bias``: as for :func:`qkv_rope`."""
        x, w = _rows(x, w)
        ada, mod, bias = _ada(x, mod, bias)
        m, k = x.shape
        n = w.shape[0] // 2
        out = x.new_empty(m, n)
        bm, bn, bk, warps, stages = _tiles("gate_up", m, n, k)
        _launcher(_gate_up_kernel)[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            x, w, out, mod, bias, m, n, k, eps, x.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk,
            ADA=ada, num_warps=warps, num_stages=stages)
        return out

    @torch.library.triton_op("tandem::pi0_step_residual", mutates_args=())
    def linear_residual(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor,
                        gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K], or attention's output [B, H, S, D] read as [B * S, H * D] (contiguous), w
        [N, K], res [M, N] -> res + x @ w^T in res's dtype; with ``gate`` ([N], PI0.5's gated
        residual) res + (x @ w^T) * gate."""
        heads = x.dim() == 4
        x = x.contiguous() if heads else _rows(x)[0]
        w, res = _rows(w, res)
        m, n = res.shape
        k = w.shape[1]
        s, xh, xd = (x.shape[2], x.shape[1], x.shape[3]) if heads else (1, 1, 0)
        out = res.new_empty(m, n)
        bm, bn, bk, warps, stages = _tiles("residual", m, n, k)
        if heads:
            bk = min(bk, _pow2(xd))  # a reduction step stays within one head
        _launcher(_residual_kernel)[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            x, w, res, out, res if gate is None else gate.reshape(-1).contiguous(), m, n, k, s, xh,
            0 if heads else x.stride(0), w.stride(0), res.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, XD=xd,
            GATED=gate is not None, num_warps=warps, num_stages=stages)
        return out
