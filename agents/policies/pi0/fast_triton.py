"""The denoising steps' attention as one Triton kernel (``FastPiSampler(step_attention="triton")``).

A denoising step attends with few queries (PI0: 51 suffix tokens x 8 query heads sharing one
key/value head) over many keys (the prefix's ~600 and the suffix's own). Unfused, that is a
bf16 score GEMM, a masked softmax, a value GEMM and the padding and copies around them: five or
more kernels a layer and step. Here one kernel does all of it, FlashAttention's way (scores,
the additive mask, an online softmax in float32 and the value sum, block by block over the keys),
with the query heads that share a key/value head stacked into one block of rows (G x Q rows, as
:func:`agents.policies.pi0.fast_attention.mqa_attention` stacks them, but read in place from the
query's own layout) and the output written in the layout the output projection reads.

It is a ``torch.library.triton_op``: eager it launches the kernel, and under ``torch.compile``
inductor places the same kernel in its generated code (symbolic batch and key length: one
compile), so CUDA graphs capture it. On a CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``, how the tests check it); :func:`triton_step_attention` falls back to
:func:`mqa_attention` on a CPU otherwise.

Arithmetic: the scores stay in float32 (eager attention rounds them to bf16 before the softmax),
so the result equals eager attention's within bf16 round-off, not bit for bit.
"""

from __future__ import annotations

import os

import torch
from torch import nn

#: rows (stacked query heads x queries) and keys per block; the head dimension is one block
BLOCK_M, BLOCK_N = 32, 64
TRITON_NAME = "tandem_triton"

try:  # triton ships with CUDA builds of torch; without it the interface falls back
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch build without triton
    triton = None


if triton is not None:

    @triton.jit
    def _step_attention_kernel(Q, K, V, M, Out, groups, q_len, k_len, hkv, scale,
                               sqb, sqh, sqq, skb, skh, skn, svb, svh, svn, smb, smq, smn, sob, soq, soh,
                               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
        """One block of BLOCK_M stacked rows (query head in the group x query) of one (batch,
        key/value head) over every key."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // hkv
        h = bh % hkv
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        r_ok = r < groups * q_len
        d_ok = d < D
        qi = r % q_len  # stacked row -> its query (the mask's row) and its query head
        head = h * groups + r // q_len
        q = tl.load(Q + b * sqb + head[:, None] * sqh + qi[:, None] * sqq + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        log2e = 1.4426950408889634
        for start in range(0, k_len, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
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
        acc = acc / l_i[:, None]
        tl.store(Out + b * sob + qi[:, None] * soq + head[:, None] * soh + d[None, :], acc.to(Out.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])

    @torch.library.triton_op("tandem::pi0_step_attention", mutates_args=())
    def stacked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """query [B, H, Q, D], key/value [B, Hkv, K, D] (each last dimension contiguous), additive
        mask [B, 1, Q, K] or [B, 1, 0, 0] for none -> [B, Q, H, D] (the layout the output
        projection reads) in the query's dtype. Query head ``j`` reads key/value head
        ``j // (H // Hkv)``, as ``repeat_kv`` has it."""
        from torch.library import wrap_triton

        query, key, value, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, mask))
        b, h, q_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        groups = h // hkv
        out = query.new_empty(b, q_len, h, d)
        has_mask = mask.numel() > 0

        def grid(meta):
            return (triton.cdiv(groups * q_len, meta["BLOCK_M"]), b * hkv)

        # Triton's interpreter (a CPU check) makes no JIT function for inductor to wrap: launch it as is
        kernel = _step_attention_kernel if _interpreted() else wrap_triton(_step_attention_kernel)
        kernel[grid](
            query, key, value, mask, out, groups, q_len, k_len, hkv, scale,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            mask.stride(0) if has_mask else 0, mask.stride(2) if has_mask else 0, mask.stride(3) if has_mask else 0,
            out.stride(0), out.stride(1), out.stride(2),
            D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_MASK=has_mask)
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
