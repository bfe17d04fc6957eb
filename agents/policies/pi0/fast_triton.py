"""The denoising steps' attention in Triton kernels (``FastPiSampler(step_attention="triton")``).

A denoising step attends with few queries (PI0: 51 suffix tokens x 8 query heads sharing one
key/value head) over many keys (the prefix's ~600 and the suffix's own). Unfused, that is a
bf16 score GEMM, a masked softmax, a value GEMM and the padding and copies around them: five or
more kernels a layer and step. Here two kernels do it, flash-decoding's way: the first computes
scores, the additive mask, an online softmax in float32 and the value sum for one split of the
keys per block (splits in parallel: a step at batch 1 has only ~400 rows, too few to fill the GPU
with blocks of rows alone), the second combines the splits. The query heads that share a
key/value head are stacked into blocks of rows (G x Q rows, as
:func:`agents.policies.pi0.fast_attention.mqa_attention` stacks them, but read in place from the
query's own layout) and the output is written in the layout the output projection reads.

It is a ``torch.library.triton_op``: eager it launches the kernels, and under ``torch.compile``
inductor places the same kernels in its generated code (symbolic batch and key length: one
compile), so CUDA graphs capture them. On a CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``, how the tests check it); :func:`triton_step_attention` falls back to
:func:`mqa_attention` on a CPU otherwise.

Arithmetic: the scores stay in float32 (eager attention rounds them to bf16 before the softmax),
so the result equals eager attention's within bf16 round-off, not bit for bit.
"""

from __future__ import annotations

import os

import torch
from torch import nn

#: the partial kernel's tiles: rows (stacked query heads x queries) per block, keys per block,
#: key blocks per split, warps; the head dimension is one block. ``TANDEM_PI0_ATTN_TILES``
#: ("16,64,2,4") overrides them, for tuning on a new GPU.
TILES = tuple(int(x) for x in os.environ.get("TANDEM_PI0_ATTN_TILES", "16,64,2,4").split(","))
#: rows per block of the combining kernel
COMBINE_ROWS = 16
TRITON_NAME = "tandem_triton"

try:  # triton ships with CUDA builds of torch; without it the interface falls back
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch build without triton
    triton = None


if triton is not None:

    @triton.jit
    def _stacked_rows(pid_m, bh, hkv, groups, q_len, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr):
        """Block ``pid_m`` of (batch, key/value head) ``bh``: the batch ``b`` and key/value head
        ``h``, the stacked row count, the block's rows ``r`` and head-dimension lanes ``d`` with
        their in-range masks, and each row's query (the mask's row) and query head."""
        b = bh // hkv
        h = bh % hkv
        rows = groups * q_len
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        return b, h, rows, r, d, r < rows, d < D, r % q_len, h * groups + r // q_len

    @triton.jit
    def _partial_kernel(Q, K, V, M, Pacc, Pml, groups, q_len, k_len, hkv, splits,
                        sqb, sqh, sqq, skb, skh, skn, svb, svh, svn, smb, smq, smn,
                        scale: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, HAS_MASK: tl.constexpr):
        """BLOCK_M stacked rows (query head in the group x query) of one (batch, key/value head)
        over one split of SPLIT_BLOCKS x BLOCK_N keys: the split's unnormalised value sum
        ``Pacc`` [BH, splits, rows, D] and its row maxima and sums ``Pml`` [BH, splits, 2, rows]."""
        bh = tl.program_id(1)
        split = tl.program_id(2)
        b, h, rows, r, d, r_ok, d_ok, qi, head = _stacked_rows(tl.program_id(0), bh, hkv, groups, q_len, D, BLOCK_D,
                                                               BLOCK_M)
        q = tl.load(Q + b * sqb + head[:, None] * sqh + qi[:, None] * sqq + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        log2e = 1.4426950408889634
        for i in range(SPLIT_BLOCKS):
            n = (split * SPLIT_BLOCKS + i) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < k_len
            k = tl.load(K + b * skb + h * skh + n[None, :] * skn + d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                        other=0.0)
            s = tl.dot(q, k) * scale
            if HAS_MASK:
                s += tl.load(M + b * smb + qi[:, None] * smq + n[None, :] * smn, mask=r_ok[:, None] & n_ok[None, :],
                             other=0.0).to(tl.float32)
            # masked keys at -1e30 (lerobot's mask is finite too; no overflow below), keys past
            # the end at -inf: they never count, even in a row that masks every key
            s = tl.where(n_ok[None, :], tl.maximum(s, -1.0e30), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2((m_i - m_new) * log2e)
            p = tl.exp2((s - m_new[:, None]) * log2e)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + b * svb + h * svh + n[:, None] * svn + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        base = bh * splits + split
        tl.store(Pacc + (base * rows + r[:, None]) * D + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
        tl.store(Pml + base * 2 * rows + r, m_i, mask=r_ok)
        tl.store(Pml + (base * 2 + 1) * rows + r, l_i, mask=r_ok)

    @triton.jit
    def _combine_kernel(Pacc, Pml, Out, groups, q_len, hkv, splits, sob, soq, soh,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """The splits' partial sums of BLOCK_M rows combined (rescaled to the overall row maximum,
        divided by the overall sum), written in the [B, Q, H, D] layout."""
        bh = tl.program_id(1)
        b, h, rows, r, d, r_ok, d_ok, qi, head = _stacked_rows(tl.program_id(0), bh, hkv, groups, q_len, D, BLOCK_D,
                                                               BLOCK_M)
        log2e = 1.4426950408889634
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for split in range(splits):
            base = bh * splits + split
            m_s = tl.load(Pml + base * 2 * rows + r, mask=r_ok, other=-1.0e30)
            l_s = tl.load(Pml + (base * 2 + 1) * rows + r, mask=r_ok, other=0.0)
            a_s = tl.load(Pacc + (base * rows + r[:, None]) * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                          other=0.0)
            m_new = tl.maximum(m, m_s)
            alpha = tl.exp2((m - m_new) * log2e)
            beta = tl.exp2((m_s - m_new) * log2e)
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            l_sum = l_sum * alpha + l_s * beta
            m = m_new
        acc = acc / l_sum[:, None]
        tl.store(Out + b * sob + qi[:, None] * soq + head[:, None] * soh + d[None, :], acc.to(Out.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])

    @torch.library.triton_op("tandem::pi0_step_attention", mutates_args=())
    def stacked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """query [B, H, Q, D], key/value [B, Hkv, K, D] (each last dimension contiguous), additive
        mask [B, 1, Q, K] or [B, 1, 0, 0] for none -> [B, Q, H, D] (the layout the output
        projection reads) in the query's dtype. Query head ``j`` reads key/value head
        ``j // (H // Hkv)``, as ``repeat_kv`` has it. Two launches: the splits of the keys in
        parallel (:func:`_partial_kernel`), then their combination (:func:`_combine_kernel`)."""
        from torch.library import wrap_triton

        query, key, value, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, mask))
        b, h, q_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        groups = h // hkv
        rows = groups * q_len
        block_m, block_n, split_blocks, warps = TILES
        splits = triton.cdiv(k_len, block_n * split_blocks)
        out = query.new_empty(b, q_len, h, d)
        pacc = query.new_empty(b * hkv, splits, rows, d, dtype=torch.float32)
        pml = query.new_empty(b * hkv, splits, 2, rows, dtype=torch.float32)
        has_mask = mask.numel() > 0
        block_d = max(16, triton.next_power_of_2(d))
        # Triton's interpreter (a CPU check) makes no JIT function for inductor to wrap: launch as is
        wrap = (lambda k: k) if _interpreted() else wrap_triton
        wrap(_partial_kernel)[(triton.cdiv(rows, block_m), b * hkv, splits)](
            query, key, value, mask, pacc, pml, groups, q_len, k_len, hkv, splits,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            mask.stride(0) if has_mask else 0, mask.stride(2) if has_mask else 0, mask.stride(3) if has_mask else 0,
            scale=scale, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_BLOCKS=split_blocks,
            HAS_MASK=has_mask, num_warps=warps)
        wrap(_combine_kernel)[(triton.cdiv(rows, COMBINE_ROWS), b * hkv)](
            pacc, pml, out, groups, q_len, hkv, splits, out.stride(0), out.stride(1), out.stride(2),
            D=d, BLOCK_D=block_d, BLOCK_M=COMBINE_ROWS, num_warps=4)
        return out


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run for tensors on ``device`` (a GPU, or Triton's interpreter)."""
    return triton is not None and (torch.device(device).type == "cuda" or _interpreted())


def triton_step_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface through :func:`stacked_attention`: query [B, H, Q, D],
    key/value [B, Hkv, K, D], additive mask [B, 1, Q, K] -> [B, Q, H, D]. Beyond ``MQA_MAX_ROWS``
    stacked rows (the prefix pass), with dropout, or where the kernel cannot run:
    :func:`mqa_attention`."""
    from agents.policies.pi0.fast_attention import MQA_MAX_ROWS, mqa_attention

    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    if g * q > MQA_MAX_ROWS or dropout or not available(query.device):
        return mqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    mask = attention_mask[:, :, :, :k] if attention_mask is not None else query.new_zeros(b, 1, 0, 0)
    out = stacked_attention(query, key, value, mask, scaling if scaling is not None else d ** -0.5)
    return out, None
