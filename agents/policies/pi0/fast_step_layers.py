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

PI0.5's AdaRMS norms (``x r (1 + scale) + shift``, then a gated residual ``x + y gate``, with
scale, shift and gate from the flow time): the kernels scale the row by ``1 + scale`` inside the
GEMM's loop and add ``shift @ W^T`` after it (:meth:`StepLayers.shift_biases`: for every step and
layer at once, once a call, beside the sampler's ``modulations``), and the residual kernels
multiply by the gate.

Where a layer cannot run them it runs as it is: projections with a bias, an activation other than
gelu's tanh form, a device without the kernels (a CPU without Triton's interpreter), and any call
whose cache is not the step buffers (``step_kv`` off). The sampler requires ``step_kv`` with the
lever.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from agents.policies.pi0 import fast_step_kernels as kernels
from agents.policies.pi0.fast_attention import ATTN_NAME, StepKV, stacked_heads
from agents.policies.stand_ins import Site, StandIns
from agents.policies.vla_common import effective_weight

log = logging.getLogger("tandem.policies.pi0_fast")

#: the projections a layer reads, in the order :meth:`_LayerSite.live` lists them
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def supported(layer: nn.Module) -> str | None:
    """Why ``layer`` (a Gemma decoder layer) cannot run the kernels, or None."""
    from transformers.activations import GELUTanh, PytorchGELUTanh

    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if (getattr(norm, "dense", None) is None) != hasattr(norm, "weight"):
            return f"a norm of kind {type(norm).__name__}"
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
        self.heads, self.layer_idx = attn.config.num_attention_heads, attn.layer_idx
        self.eps = (float(src.input_layernorm.eps), float(src.post_attention_layernorm.eps))
        for name, (n, k) in widths.items():
            self.register_buffer(name, torch.empty(n, k, device=device, dtype=dtype))

    # the layer's own modules, for callers that read them (dtype, config) or run them one by one
    # (the sampler's AdaRMS path where the kernels do not run)
    self_attn = property(lambda self: self.src.self_attn)
    mlp = property(lambda self: self.src.mlp)
    input_layernorm = property(lambda self: self.src.input_layernorm)
    post_attention_layernorm = property(lambda self: self.src.post_attention_layernorm)

    #: calls of more rows (batch x suffix) than this run the layer as it is (None: no limit)
    max_rows: int | None = None

    def runs(self, hidden: torch.Tensor, cache) -> bool:
        """Whether a call over ``hidden`` with ``cache`` runs the kernels."""
        rows_ok = self.max_rows is None or hidden.shape[0] * hidden.shape[1] <= self.max_rows
        return isinstance(cache, StepKV) and kernels.available(hidden.device) and rows_ok

    def ada_mods(self, mods: list[torch.Tensor], i: int, n: int) -> tuple[torch.Tensor, ...]:
        """PI0.5: this layer's (input norm, post-attention norm) modulations and the two shift
        biases, from the sampler's per-step ``mods`` (``n`` layers' norms, the final norm, then
        :meth:`StepLayers.shift_biases`)."""
        j = 2 * n + 1 + 2 * self.ordinal
        return mods[2 * i], mods[2 * i + 1], mods[j], mods[j + 1]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, position_embeddings=None, ada: tuple | None = None, **kwargs) -> torch.Tensor:
        """The decoder layer; ``ada`` (PI0.5): :meth:`ada_mods`' four tensors for this step."""
        if not self.runs(hidden_states, past_key_values):
            if ada is not None:
                raise RuntimeError("step layers: an AdaRMS call where the kernels do not run (check runs() first)")
            return self.src(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        from transformers.models.gemma.modeling_gemma import ALL_ATTENTION_FUNCTIONS, eager_attention_forward

        b, s, width = hidden_states.shape
        x = hidden_states.reshape(b * s, width)
        cos, sin = (t.expand(b, s, t.shape[-1]).reshape(b * s, t.shape[-1]) for t in position_embeddings)
        mod_in, mod_post, b_qkv, b_gu = ada if ada is not None else (None,) * 4
        gates = (None, None) if ada is None else (mod_in[..., 2 * width:], mod_post[..., 2 * width:])
        kb, vb = past_key_values.k[self.layer_idx], past_key_values.v[self.layer_idx]
        q = kernels.qkv_rope(x, self.w_qkv, cos, sin, kb, vb, s, self.heads, self.eps[0], mod_in, b_qkv)  # k, v: kb, vb
        attn = self.src.self_attn
        impl = attn.config._attn_implementation  # noqa: SLF001
        if impl == ATTN_NAME:  # the output as its GEMM writes it, [B, H, S, D]: o_proj's kernel reads that
            out = stacked_heads(q, kb, vb, attention_mask, attn.scaling)
        else:
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
            out = fn(attn, q, kb, vb, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)[0]
            out = out.reshape(b * s, -1)
        x = kernels.linear_residual(out, self.w_o, x, gates[0])
        h = kernels.gate_up(x, self.w_gate_up, self.eps[1], mod_post, b_gu)
        return kernels.linear_residual(h, self.w_down, x, gates[1]).view(b, s, width)


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
        # the norms' weights (PI0; PI0.5's AdaRMS norms have none: their scale comes per step)
        norms = [getattr(n, "weight", None) for n in (self.layer.input_layernorm, self.layer.post_attention_layernorm)]
        n1, n2 = (1.0 if w is None else (1.0 + w.float())[None, :] for w in norms)
        s = self.stand_in
        s.w_qkv.copy_(torch.cat([q, k, v]) * n1)
        s.w_o.copy_(o)
        s.w_gate_up.copy_(torch.cat([g, u]) * n2)
        s.w_down.copy_(d)
        self.bind(mods, [p for _, _, srcs in ws for p in srcs] + [w for w in norms if w is not None])

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
    can run the kernels: :meth:`sync` before a call, :meth:`swapped` around the steps. With
    ``max_rows`` only calls of at most that many rows (batch x suffix) run the kernels; the others
    run the layers as they are (with the sampler's other expert levers, the fused projections)."""

    def __init__(self, lm: nn.Module, max_rows: int | None = None):
        layers = lm.layers
        why = {i: supported(layers[i]) for i in range(lm.config.num_hidden_layers)}
        with torch.inference_mode(False), torch.no_grad():
            sites = [_LayerSite(layers, i) for i, w in why.items() if w is None]
        super().__init__(sites, "step layers")
        for j, site in enumerate(sites):
            site.stand_in.ordinal = j  # where its shift biases sit after the norms' modulations
            site.stand_in.max_rows = max_rows
        if len(sites) < len(why):
            log.info("PI fast path: step layers: %d of %d expert layers run as they are (%s)",
                     len(why) - len(sites), len(why), sorted({w for w in why.values() if w}))
        mb = sum(b.numel() * b.element_size() for s in sites for b in s.stand_in.buffers()) / 1e6
        log.info("PI fast path: step layers for %d expert layers (%.0f MB of prepared weights)", len(sites), mb)

    def shift_biases(self, mods: list[torch.Tensor]) -> list[torch.Tensor]:
        """PI0.5: for every stand-in layer (in order), ``shift @ W^T`` of its input norm through
        the stacked q/k/v and of its post-attention norm through gate/up, for every flow time at
        once ([S, N] each), from the sampler's ``modulations`` (each norm's [S, 3 width])."""
        out = []
        for site in self.sites:
            i, layer = site.index, site.stand_in
            width = layer.w_qkv.shape[1]
            for m, w in ((mods[2 * i], layer.w_qkv), (mods[2 * i + 1], layer.w_gate_up)):
                out.append(nn.functional.linear(m[:, width:2 * width].to(w.dtype), w))
        return out
