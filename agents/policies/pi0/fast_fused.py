"""Fused projections for PI0's fast serving path (``policy.fast_fuse_proj``), off by default; the
training path (lerobot's modules as they are) never sees them.

Each Gemma decoder layer runs seven linear layers: q, k, v and o in attention, gate, up and
down in the MLP. q, k and v read the same input, as do gate and up, so each group can be one
GEMM over the rows of its weights stacked: ``[q; k; v] x`` then split, ``[gate; up] x`` then
split. At batch 1 a denoising step's GEMMs have ~51 rows and k / v have 256 outputs: each is a
kernel of a few thread blocks on a GPU of 132 SMs, and the call is bound by the number of
kernels more than by their arithmetic; stacked, a layer runs four GEMMs instead of seven.

With the lever each layer's ``self_attn`` and ``mlp`` are replaced, around the fast path's own
calls only (the expert's denoising steps; with ``all`` also the VLM's prefix pass), by
:class:`FusedAttention` / :class:`FusedMLP`: transformers' ``GemmaAttention.forward`` and
``GemmaMLP.forward`` arithmetic over a stacked copy of the effective weights (the folded weight,
or base + LoRA where adapters are live: :func:`agents.policies.vla_common.effective_weight`),
with the layer's own ``o_proj`` / ``down_proj`` and attention function. The copies cost memory
(the expert: ~0.4 GB in bf16; the VLM: ~2.6 GB).

New weights: as for the other levers, before every call :meth:`FusedProjections.sync` compares
each source parameter's version counter and the module at each projection (folded Linear or
live peft wrapper) with what was last copied, and re-stacks what changed into the same tensors
(the CUDA graphs read them in place: no recapture).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from agents.policies.stand_ins import Site, StandIns
from agents.policies.vla_common import effective_weight

log = logging.getLogger("tandem.policies.pi0_fast")

#: ``policy.fast_fuse_proj``: auto (all on a GPU, off elsewhere) | off | expert (the denoising
#: steps) | all (the VLM's prefix pass too)
FUSE_CHOICES = ("auto", "off", "expert", "all")
#: (block attribute of a decoder layer, the projections stacked into one GEMM)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
#: the same for SigLIP's encoder layers (``fuse_vision``): q, k and v (its MLP has no parallel pair)
VISION_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")),)


def resolve_fuse(value: Any, cuda: bool = False) -> str | None:
    """``policy.fast_fuse_proj`` -> None (off), "expert" or "all"; ``auto``: "all" where the fast
    path runs on a GPU (``cuda``), off elsewhere."""
    v = str(value).strip().lower()
    if v == "auto":
        return "all" if cuda else None
    if v in ("off", "false", "none", "0", ""):
        return None
    if v in FUSE_CHOICES:
        return v
    raise ValueError(f"policy.fast_fuse_proj must be one of {FUSE_CHOICES}, got {value!r}")


class _Stacked(nn.Module):
    """The stacked weight (and bias) of one group; ``parts``: each projection's output width."""

    def __init__(self, parts: list[int], in_features: int, bias: bool, device, dtype):
        super().__init__()
        self.parts = parts
        self.register_buffer("weight", torch.empty(sum(parts), in_features, device=device, dtype=dtype))
        self.register_buffer("bias", torch.empty(sum(parts), device=device, dtype=dtype) if bias else None)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.parts, dim=-1)


class FusedAttention(nn.Module):
    """transformers' ``GemmaAttention.forward`` with q, k and v as one GEMM (module docstring);
    ``src`` is the attention module it stands in for (its ``o_proj``, config and sizes)."""

    def __init__(self, src: nn.Module, stacked: _Stacked):
        super().__init__()
        self.src, self.stacked = src, stacked
        self.config, self.layer_idx, self.head_dim = src.config, src.layer_idx, src.head_dim
        self.num_key_value_groups, self.scaling = src.num_key_value_groups, src.scaling
        self.attention_dropout = src.attention_dropout
        self.is_causal = getattr(src, "is_causal", True)
        self.train(src.training)

    @property
    def q_proj(self) -> nn.Module:
        """The layer's own q projection (what callers read ``.weight.dtype`` of; unused here)."""
        return self.src.q_proj

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        from transformers.models.gemma.modeling_gemma import (ALL_ATTENTION_FUNCTIONS, apply_rotary_pos_emb,
                                                              eager_attention_forward)

        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in self.stacked.split(hidden_states))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,  # noqa: SLF001
                                                     eager_attention_forward)
        out, weights = attn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                            scaling=self.scaling, **kwargs)
        return self.src.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class FusedVisionAttention(nn.Module):
    """transformers' ``SiglipAttention.forward`` with q, k and v (and their biases) as one GEMM;
    ``src`` the attention it stands in for (its ``out_proj``, config and sizes)."""

    def __init__(self, src: nn.Module, stacked: _Stacked):
        super().__init__()
        self.src, self.stacked = src, stacked
        self.config, self.head_dim, self.scale, self.dropout = src.config, src.head_dim, src.scale, src.dropout
        self.is_causal = False
        self.train(src.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        from transformers.models.siglip.modeling_siglip import ALL_ATTENTION_FUNCTIONS, eager_attention_forward

        input_shape = hidden_states.shape[:-1]
        q, k, v = (t.reshape(*input_shape, -1, self.head_dim).transpose(1, 2) for t in self.stacked.split(hidden_states))
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,  # noqa: SLF001
                                                     eager_attention_forward)
        out, weights = attn(self, q, k, v, attention_mask, is_causal=False, scaling=self.scale,
                            dropout=0.0 if not self.training else self.dropout)
        return self.src.out_proj(out.reshape(*input_shape, -1).contiguous()), weights


class FusedMLP(nn.Module):
    """transformers' ``GemmaMLP.forward`` with gate and up as one GEMM; ``src`` the MLP it stands
    in for (its ``down_proj`` and activation)."""

    def __init__(self, src: nn.Module, stacked: _Stacked):
        super().__init__()
        self.src, self.stacked = src, stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.stacked.split(x)
        return self.src.down_proj(self.src.act_fn(gate) * up)


class _Site(Site):
    """One group of one layer: the block it stands in for, its stand-in, what it was stacked from."""

    def __init__(self, layer: nn.Module, block: str, names: tuple[str, ...], dtype: torch.dtype | None = None):
        self.layer, self.block, self.names = layer, block, names
        self.src = layer._modules[block]  # noqa: SLF001
        ws = [effective_weight(m) for m in self.live()]
        k = {w.shape[1] for w, _, _ in ws}
        if len(k) != 1:
            raise ValueError(f"fused projections: {block} {names} read inputs of different widths {sorted(k)}")
        has_bias = [b is not None for _, b, _ in ws]
        if any(has_bias) and not all(has_bias):
            raise ValueError(f"fused projections: {block} {names} mix layers with and without bias")
        m0 = self.live()[0]
        w0 = (m0.base_layer if hasattr(m0, "base_layer") else m0).weight
        self.stacked = _Stacked([w.shape[0] for w, _, _ in ws], k.pop(), all(has_bias), w0.device, dtype or w0.dtype)
        kind = FusedMLP if block != "self_attn" else FusedVisionAttention if hasattr(self.src, "out_proj") \
            else FusedAttention
        self.stand_in = kind(self.src, self.stacked)
        self.refresh()

    def live(self) -> list[nn.Module]:
        return [self.src._modules[n] for n in self.names]  # noqa: SLF001

    @torch.no_grad()
    def refresh(self) -> None:
        parts = self.live()
        if all(type(m) is nn.Linear for m in parts):  # folded (serving): the rows copied as they are
            off, srcs = 0, []
            for m in parts:
                n = m.weight.shape[0]
                self.stacked.weight[off:off + n].copy_(m.weight)
                if self.stacked.bias is not None:
                    self.stacked.bias[off:off + n].copy_(m.bias)
                srcs += [m.weight] + ([m.bias] if m.bias is not None else [])
                off += n
            self.bind(parts, srcs)
            return
        ws = [effective_weight(m) for m in parts]  # live adapters: base + scale * B @ A, in float32
        self.stacked.weight.copy_(torch.cat([w for w, _, _ in ws]).to(self.stacked.weight.dtype))
        if self.stacked.bias is not None:
            self.stacked.bias.copy_(torch.cat([b for _, b, _ in ws]).to(self.stacked.bias.dtype))
        self.bind(parts, [p for _, _, s in ws for p in s])

    def installed(self) -> bool:
        return self.layer._modules[self.block] is self.stand_in  # noqa: SLF001

    def install(self) -> None:
        if self.layer._modules[self.block] is not self.src:  # noqa: SLF001
            raise RuntimeError(f"fused projections: a layer's {self.block} was replaced since they were built")
        self.layer._modules[self.block] = self.stand_in  # noqa: SLF001

    def restore(self) -> None:
        self.layer._modules[self.block] = self.src  # noqa: SLF001


class FusedProjections(StandIns):
    """The stand-ins of every layer in ``layers`` (a Gemma language model's decoder layers, or
    with ``VISION_GROUPS`` SigLIP's encoder layers; ``dtype``: of the stacked copies, default the
    weights'): :meth:`sync` before a call, :meth:`swapped` around the fast path's computation."""

    def __init__(self, layers: list[nn.Module], name: str, groups=GROUPS, dtype: torch.dtype | None = None):
        with torch.inference_mode(False), torch.no_grad():
            sites = [_Site(layer, block, names, dtype) for layer in layers for block, names in groups]
        super().__init__(sites, f"fused projections ({name})")
        mb = sum(s.stacked.weight.numel() * s.stacked.weight.element_size() for s in self.sites) / 1e6
        log.info("PI fast path: fused projections in the %s: %d groups (%.0f MB of stacked weights)",
                 name, len(self.sites), mb)

    @property
    def restacked(self) -> int:
        """Groups re-stacked by sync (tests and logs read it)."""
        return self.refreshed
