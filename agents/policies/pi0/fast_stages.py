"""The PI0 / PI0.5 fast path's layer stacks and prefix stages as functions of their modules (the module first,
then tensors), so that :class:`agents.policies.fast_aot.AotFunctions` can compile them ahead of
time with the weights read live from the module given: SigLIP + projector
(:func:`embed_images`) and the VLM layer stack over the prefix (:func:`vlm_prefix`, which
:class:`agents.policies.pi0.fast.FastPiSampler` also runs through ``torch.compile``)."""

from __future__ import annotations

import torch
from torch import nn

from agents.policies.pi0.fast_attention import _additive, _PrefixKV


def plain_layers(lm: nn.Module, hidden: torch.Tensor, mask2d: torch.Tensor | None, pos: torch.Tensor,
                 cache, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``lm``'s decoder layers over ``hidden`` as transformers runs them, with ``cache`` (a
    :class:`_PrefixKV` or :class:`StepKV`) and the additive ``mask`` (built from ``mask2d`` when
    not given)."""
    dtype = lm.layers[0].self_attn.q_proj.weight.dtype
    hidden = hidden.to(dtype) if dtype == torch.bfloat16 else hidden
    mask = _additive(mask2d, hidden.dtype) if mask is None else mask
    pe = lm.rotary_emb(hidden, pos)
    for layer in lm.layers[: lm.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                       position_embeddings=pe)
    return hidden


def vlm_prefix(vlm: nn.Module, embs: torch.Tensor, pad: torch.Tensor) -> tuple[list, list]:
    """The VLM layer stack over the prefix embeddings ``embs`` [B, P, D] with pad mask ``pad``
    [B, P]: each layer's keys and values (a function of the module: compiled ahead of time)."""
    mask2d = pad[:, None, :] & pad[:, :, None]
    pos = torch.cumsum(pad, dim=1) - 1
    cache = _PrefixKV(len(vlm.layers))
    plain_layers(vlm, embs, mask2d, pos, cache)
    return cache.k, cache.v


def embed_images(paligemma: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """lerobot's ``PaliGemmaWithExpertModel.embed_image`` as a function of the PaliGemma model
    (``pwe.paligemma.model``: transformers' class, which a saved function can name): SigLIP and
    the projector in float32, the features back in the images' dtype."""
    out_dtype = images.dtype
    features = paligemma.get_image_features(images.to(torch.float32)).pooler_output
    return features.to(out_dtype) if features.dtype != out_dtype else features


def ada_norm(norm: nn.Module, x: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lerobot's ``PiGemmaRMSNorm.forward(x, cond)`` with ``mod = norm.dense(cond)`` given
    ([1 or B, 3 * width]): (normed, gate)."""
    scale, shift, gate = mod.unsqueeze(1).chunk(3, dim=-1)
    normed = norm._norm(x) * (1 + scale.float()) + shift.float()  # noqa: SLF001
    return normed.to(x.dtype), gate.to(x.dtype)


def ada_layers(lm: nn.Module, hidden: torch.Tensor, mask2d: torch.Tensor | None, pos: torch.Tensor, cache,
               mods: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """PI0.5's expert layers over ``hidden`` with each AdaRMS norm's modulation given (``mods``,
    [1, 3 * width] each, in ``FastPiSampler.modulations``' order): lerobot's decoder-layer
    arithmetic, then the final norm. A step layer (``agents/policies/pi0/fast_step_layers.py``)
    that takes the call runs its kernels with its share of ``mods``."""
    from lerobot.policies.pi_gemma import _gated_residual

    dtype = lm.layers[0].self_attn.q_proj.weight.dtype
    hidden = hidden.to(dtype) if dtype == torch.bfloat16 else hidden
    mask = _additive(mask2d, hidden.dtype) if mask is None else mask
    pe = lm.rotary_emb(hidden, pos)
    n = lm.config.num_hidden_layers
    for i, layer in enumerate(lm.layers[:n]):
        if hasattr(layer, "ada_mods") and layer.runs(hidden, cache):  # a step layer
            hidden = layer(hidden, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                           position_embeddings=pe, ada=layer.ada_mods(mods, i, n))
            continue
        h, gate = ada_norm(layer.input_layernorm, hidden, mods[2 * i])
        h, _ = layer.self_attn(h, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                               position_embeddings=pe)
        hidden = _gated_residual(hidden, h, gate)
        h, gate = ada_norm(layer.post_attention_layernorm, hidden, mods[2 * i + 1])
        hidden = _gated_residual(hidden, layer.mlp(h), gate)
    return ada_norm(lm.norm, hidden, mods[2 * n])[0]
