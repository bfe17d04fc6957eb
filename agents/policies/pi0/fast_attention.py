"""Attention pieces of PI0's fast serving path (:mod:`agents.policies.pi0.fast`): what
transformers' Gemma attention asks of a cache (:class:`_PrefixKV`: the prefix's keys and values,
read by every denoising step; :class:`StepKV`: the same in per-layer buffers written once a
call), the additive masks, and :func:`mqa_attention` (query heads that share a key/value head as
one GEMM).

:class:`StepKV` (``FastPiSampler(step_kv=True)``; on by default on a GPU, ``policy.fast_step_kv``): each layer's keys and values
live in one buffer per call, ``[suffix | prefix | padding]`` with the length a multiple of 8, the
prefix's copied in once; a denoising step writes its suffix keys/values into the first rows in
place and attends over the whole buffer, with the step's additive mask built once per call
(not per step) in the same layout. Without it each step and layer concatenates the prefix's
keys/values with the suffix's and pads both to a multiple of 8, and the mask is rebuilt inside
each layer's softmax. Attention does not depend on the order of its keys (rotary positions are
applied before they are stored), so the suffix goes first and its rows do not move when the
prefix length changes.
"""

from __future__ import annotations

import os

import torch
from torch import nn


class _PrefixKV:
    """What GemmaAttention asks of a cache (``update(k, v, layer_idx)``). Recording: keep each
    layer's prefix keys/values and attend over them. Extending: attend over prefix ⊕ new, keep
    nothing (every denoising step starts from the same prefix)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.recording = True

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.recording:
            self.k[layer_idx], self.v[layer_idx] = key, value
            return key, value
        return (torch.cat([self.k[layer_idx], key], dim=2), torch.cat([self.v[layer_idx], value], dim=2))


def _additive(mask2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool -> [B, 1, Q, K] additive mask in ``dtype`` (lerobot's masked value, finite,
    so a fully masked row attends uniformly instead of producing NaN)."""
    neg = torch.finfo(dtype).min if dtype != torch.float32 else -2.3819763e38
    zero = torch.zeros((), dtype=dtype, device=mask2d.device)
    return torch.where(mask2d[:, None], zero, torch.full((), neg, dtype=dtype, device=mask2d.device))


#: queries per key/value head (heads sharing it x query tokens) up to which ``mqa_attention``
#: computes attention itself; beyond, SDPA (the prefix: ~800 queries, the kernel is efficient)
MQA_MAX_ROWS = 1024
ATTN_NAME = "tandem_mqa"
#: key counts up to which the softmax's reduction has a known bound when compiled (inductor runs
#: a reduction of at most 1024 as one persistent kernel; with no bound on a symbolic size, a
#: looped one); env TANDEM_PI0_SOFTMAX_BOUND overrides it, 0: no bound (for benchmarks)
SOFTMAX_BOUND = int(os.environ.get("TANDEM_PI0_SOFTMAX_BOUND", "1024"))


def mqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (eager attention's arithmetic: scores in the model's
    dtype, softmax in float32) without ``repeat_kv``: the G query heads of each key/value head
    are stacked into one [G*Q, D] operand, so QK^T and PV are one GEMM per key/value head.
    query [B, H, Q, D], key/value [B, Hkv, K, D], additive mask [B, 1, Q, K] -> [B, Q, H, D]."""
    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    if g * q > MQA_MAX_ROWS or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else d ** -0.5
    pad = -k % 8  # keys padded to a multiple of 8: aligned GEMMs (851 keys ran an align1 kernel)
    if pad:
        key, value = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (key, value))
        neg = torch.finfo(query.dtype).min
        if attention_mask is None:
            attention_mask = torch.zeros(b, 1, q, k, dtype=query.dtype, device=query.device)
        attention_mask = nn.functional.pad(attention_mask[..., :k], (0, pad), value=neg)
        k += pad
    out = stacked_heads(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def stacked_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """:func:`mqa_attention`'s arithmetic with the key count already a multiple of 8, the output
    left as the GEMM writes it: [B, H, Q, D] (query [B, H, Q, D], key/value [B, Hkv, K, D],
    additive mask [B, 1, Q, >= K])."""
    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    if SOFTMAX_BOUND:
        bounded(k, SOFTMAX_BOUND)
    scores = torch.matmul(query.reshape(b, hkv, g * q, d), key.transpose(2, 3)) * scale
    scores = scores.view(b, hkv, g, q, k)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :k]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs.view(b, hkv, g * q, k), value).view(b, h, q, d)


def bounded(n, limit: int) -> bool:
    """``n <= limit``. For a symbolic size under dynamo the branch is a guard, and a guard
    narrows the size's range: where it holds, the graph is traced with ``n`` at most ``limit``
    (what lets inductor pick kernels that need a static bound); where it does not, another graph."""
    if n <= limit:  # a branch, not a value: dynamo keeps an unused comparison symbolic, no guard
        return True
    return False


#: the attention interface of the denoising steps with ``step_attention="flex"``
FLEX_NAME = "tandem_flex"
#: the flex kernel's tiles: its defaults ask 288 KB of shared memory at PI0's head dimension
#: (256), past an H200's 227 KB
FLEX_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4}


def flex_step_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`mqa_attention`'s interface through FlexAttention (``FastPiSampler(step_attention="flex")``,
    off): where few queries meet many keys (a denoising step), the whole attention (scores, the
    additive mask as a score modification, softmax, the value sum) is one fused kernel under
    torch.compile, the query heads of a key/value head packed together (``enable_gqa``); eager,
    torch's reference computation. Beyond ``MQA_MAX_ROWS`` rows: :func:`mqa_attention`."""
    b, h, q, d = query.shape
    if (h // key.shape[1]) * q > MQA_MAX_ROWS or dropout or d < 16:  # flex's kernel takes heads of 16+
        return mqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from torch.nn.attention.flex_attention import flex_attention

    mask = attention_mask

    def add_mask(score, bi, hi, qi, ki):
        return score if mask is None else score + mask[bi, 0, qi, ki]

    out = flex_attention(query, key, value, score_mod=add_mask, enable_gqa=True,
                         scale=scaling if scaling is not None else d ** -0.5, kernel_options=FLEX_OPTIONS)
    return out.transpose(1, 2).contiguous(), None


#: the attention interface of SigLIP and the prefix pass with ``prefix_attention="cudnn"``
CUDNN_NAME = "tandem_cudnn"


def cudnn_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface through cuDNN's fused attention, called as its own op
    (``aten._scaled_dot_product_cudnn_attention``, ``FastPiSampler(prefix_attention="cudnn")``):
    which kernel runs is then part of the traced graph. Through SDPA the kernel is chosen from
    the backend order in force when a graph is traced, and the compile caches do not key on that
    order: a graph cached under another order keeps that order's kernel. The key/value heads are
    repeated for the query heads that share them; the additive mask goes in as cuDNN's bias.
    Elsewhere (not on a GPU, dropout, a head dimension that is not a multiple of 8 up to 256, a
    key count not a multiple of 8, a boolean mask): SDPA as transformers calls it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    boolean = attention_mask is not None and attention_mask.dtype == torch.bool
    if not query.is_cuda or dropout or d % 8 or d > 256 or k % 8 or boolean:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if hkv != h:
        key, value = (t[:, :, None].expand(b, hkv, h // hkv, k, d).reshape(b, h, k, d) for t in (key, value))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, attention_mask, False, 0.0, False,
                                                             False, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _register_attention(*extra: tuple[str, object]) -> None:
    """This module's attention functions (and ``extra`` (name, function) pairs) in transformers'
    attention registry, once."""
    from transformers import AttentionInterface

    for name, fn in ((ATTN_NAME, mqa_attention), (FLEX_NAME, flex_step_attention), (CUDNN_NAME, cudnn_attention),
                     *extra):
        if name not in AttentionInterface._global_mapping:  # noqa: SLF001
            AttentionInterface.register(name, fn)


class StepKV:
    """Per-layer key/value buffers for the denoising steps (module docstring): built from a
    recorded :class:`_PrefixKV` (``k``, ``v`` [B, Hkv, P, D] per layer), the prefix pad mask
    [B, P], the suffix's length ``s`` and its ar-mask ``ar`` [s]; ``mask`` is the steps'
    additive mask [B, 1, s, K] in ``dtype``."""

    def __init__(self, prefix: _PrefixKV, pad: torch.Tensor, s: int, ar: torch.Tensor, dtype: torch.dtype):
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        b, p = pad.shape
        tail = -(s + p) % 8
        self.k, self.v = [], []
        for src, out in ((prefix.k, self.k), (prefix.v, self.v)):
            for t in src:
                buf = t.new_zeros(t.shape[0], t.shape[1], s + p + tail, t.shape[3])
                buf[:, :, s:s + p] = t
                out.append(buf)
        ones = torch.ones(b, s, dtype=torch.bool, device=pad.device)
        mask2d = torch.cat([make_att_2d_masks(ones, ar[None].expand(b, s)), pad[:, None, :].expand(b, s, p),
                            torch.zeros(b, s, tail, dtype=torch.bool, device=pad.device)], dim=2)
        self.mask = _additive(mask2d, dtype)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The step's suffix keys/values into the first rows of the layer's buffers, in place."""
        kb, vb = self.k[layer_idx], self.v[layer_idx]
        kb[:, :, : key.shape[2]] = key
        vb[:, :, : value.shape[2]] = value
        return kb, vb
