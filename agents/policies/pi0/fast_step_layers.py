"""The denoising steps' decoder layers as a few Triton kernels (``FastPiSampler(step_layers="triton")``,
off by default; the prefix pass and the training path never see them).

A PI0 expert layer-step runs, around its attention, an RMS norm, the q/k/v projection, the rotary
embedding, the copy of its keys/values into the step buffers, the output projection and residual,
another RMS norm, gate/up, gelu x up, the down projection and residual: about a dozen kernels
besides attention when compiled, each short at ~51 rows. :class:`StepLayer` stands in for each
expert decoder layer around the fast path's velocity call and runs
:mod:`agents.policies.pi0.fast_step_kernels`' three kernels instead: ``qkv_rope`` (norm, q/k/v,
rotary; k and v written into the step buffers, :class:`agents.policies.pi0.fast_attention.StepKV`),
the attention the sampler is set to over those buffers (the default's, ``stacked_heads``, with its
output left as [B, H, S, D]), ``linear_residual`` (o_proj + residual, reading that layout as it
is), ``gate_up`` (norm, gate/up, gelu x up) and ``linear_residual`` again (down + residual).

Weights: each layer's q/k/v and gate/up are stacked with the preceding norm's ``1 + weight``
folded into their input columns (``(x r (1 + w)) @ W^T = r (x @ (W diag(1 + w))^T)``, ``r`` the row's
inverse RMS, applied inside the kernel), o_proj and down_proj copied: the effective weights (the
folded ones, or base + LoRA where adapters are live), re-made in place when their sources change
(version counters, as the other levers: no recapture), ~35 MB a layer for PI0's expert in bf16.

Where a layer cannot run them it runs as it is: PI0.5's AdaRMS norms (the time-conditioned
scale, shift and gate; not done yet), projections with a bias, an activation other than gelu's
tanh form, a device without the kernels (a CPU without Triton's interpreter), and any call whose
cache is not the step buffers (``step_kv`` off). The sampler requires ``step_kv`` with the lever.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from agents.policies.pi0 import fast_step_kernels as kernels
from agents.policies.pi0.fast_attention import ATTN_NAME, StepKV, stacked_heads
from agents.policies.pi0.stand_ins import Site, StandIns
from agents.policies.vla_common import effective_weight

log = logging.getLogger("tandem.policies.pi0_fast")

#: the projections a layer reads, in the order :meth:`_LayerSite.live` lists them
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def supported(layer: nn.Module) -> str | None:
    """Why ``layer`` (a Gemma decoder layer) cannot run the kernels, or None."""
    from transformers.activations import GELUTanh, PytorchGELUTanh

    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if getattr(norm, "dense", None) is not None or not hasattr(norm, "weight"):
            return "adaptive (AdaRMS) norms"
    if not isinstance(layer.mlp.act_fn, (GELUTanh, PytorchGELUTanh)):
        return f"activation {type(layer.mlp.act_fn).__name__}"
    for block, name in PROJECTIONS:
        if effective_weight(getattr(getattr(layer, block), name))[1] is not None:
            return f"{block}.{name} has a bias"
    return None


class StepLayer(nn.Module):
    """A Gemma decoder layer's forward through the step kernels (module docstring); ``src`` is
    the layer it stands in for (its attention settings, and its forward where the kernels
    cannot run)."""

    def __init__(self, src: nn.Module, widths: dict[str, tuple[int, int]], device, dtype):
        super().__init__()
        self.src = src
        attn = src.self_attn
        self.heads, self.kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.head_dim, self.layer_idx = attn.head_dim, attn.layer_idx
        self.eps = (float(src.input_layernorm.eps), float(src.post_attention_layernorm.eps))
        for name, (n, k) in widths.items():
            self.register_buffer(name, torch.empty(n, k, device=device, dtype=dtype))

    @property
    def self_attn(self) -> nn.Module:
        """The layer's own attention (what callers read the dtype and config of)."""
        return self.src.self_attn

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, position_embeddings=None, **kwargs) -> torch.Tensor:
        if not isinstance(past_key_values, StepKV) or not kernels.available(hidden_states.device):
            return self.src(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        from transformers.models.gemma.modeling_gemma import ALL_ATTENTION_FUNCTIONS, eager_attention_forward

        b, s, width = hidden_states.shape
        x = hidden_states.reshape(b * s, width)
        cos, sin = (t.expand(b, s, t.shape[-1]).reshape(b * s, t.shape[-1]) for t in position_embeddings)
        kb, vb = past_key_values.k[self.layer_idx], past_key_values.v[self.layer_idx]
        q = kernels.qkv_rope(x, self.w_qkv, cos, sin, kb, vb, s, self.heads, self.eps[0])  # k, v into kb, vb
        attn = self.src.self_attn
        impl = attn.config._attn_implementation  # noqa: SLF001
        if impl == ATTN_NAME:  # the output as its GEMM writes it, [B, H, S, D]: o_proj's kernel reads that
            out = stacked_heads(q, kb, vb, attention_mask, attn.scaling)
        else:
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
            out = fn(attn, q, kb, vb, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)[0]
            out = out.reshape(b * s, -1)
        x = kernels.linear_residual(out, self.w_o, x)
        h = kernels.gate_up(x, self.w_gate_up, self.eps[1])
        return kernels.linear_residual(h, self.w_down, x).view(b, s, width)


class _LayerSite(Site):
    """One decoder layer of a language model's ``layers`` list and its :class:`StepLayer`."""

    def __init__(self, layers: nn.ModuleList, index: int):
        self.layers, self.index = layers, index
        self.layer = layer = layers[index]
        q, k, v, o, g, u, d = (effective_weight(m)[0] for m in self.live())
        w0 = layer.self_attn.o_proj
        w0 = (w0.base_layer if hasattr(w0, "base_layer") else w0).weight
        widths = {"w_qkv": (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]), "w_o": tuple(o.shape),
                  "w_gate_up": (g.shape[0] + u.shape[0], g.shape[1]), "w_down": tuple(d.shape)}
        self.stand_in = StepLayer(layer, widths, w0.device, w0.dtype)
        self.refresh()

    def live(self) -> list[nn.Module]:
        return [getattr(self.layer, block)._modules[name] for block, name in PROJECTIONS]  # noqa: SLF001

    @torch.no_grad()
    def refresh(self) -> None:
        mods = self.live()
        ws = [effective_weight(m) for m in mods]
        q, k, v, o, g, u, d = (w for w, _, _ in ws)
        n1, n2 = self.layer.input_layernorm.weight, self.layer.post_attention_layernorm.weight
        s = self.stand_in
        s.w_qkv.copy_(torch.cat([q, k, v]) * (1.0 + n1.float())[None, :])
        s.w_o.copy_(o)
        s.w_gate_up.copy_(torch.cat([g, u]) * (1.0 + n2.float())[None, :])
        s.w_down.copy_(d)
        self.bind(mods, [p for _, _, srcs in ws for p in srcs] + [n1, n2])

    def installed(self) -> bool:
        return self.layers[self.index] is self.stand_in

    def install(self) -> None:
        if self.layers[self.index] is not self.layer:
            raise RuntimeError("step layers: a decoder layer was replaced since they were built")
        self.layers[self.index] = self.stand_in

    def restore(self) -> None:
        self.layers[self.index] = self.layer


class StepLayers(StandIns):
    """:class:`StepLayer` stand-ins for the decoder layers of ``lm`` (the action expert) that
    can run the kernels: :meth:`sync` before a call, :meth:`swapped` around the steps."""

    def __init__(self, lm: nn.Module):
        layers = lm.layers
        why = {i: supported(layers[i]) for i in range(lm.config.num_hidden_layers)}
        with torch.inference_mode(False), torch.no_grad():
            sites = [_LayerSite(layers, i) for i, w in why.items() if w is None]
        super().__init__(sites, "step layers")
        if len(sites) < len(why):
            log.info("PI fast path: step layers: %d of %d expert layers run as they are (%s)",
                     len(why) - len(sites), len(why), sorted({w for w in why.values() if w}))
        mb = sum(b.numel() * b.element_size() for s in sites for b in s.stand_in.buffers()) / 1e6
        log.info("PI fast path: step layers for %d expert layers (%.0f MB of prepared weights)", len(sites), mb)
