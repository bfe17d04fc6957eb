"""The fast serving path for lerobot's PI0 / PI0.5: the same modules and weights, run as one
CUDA graph per served batch size.

Why: lerobot's ``sample_actions`` is launch- and host-bound at batch 1 (a few TFLOP a call:
milliseconds of GPU arithmetic in a call many times longer). Each of its 10 denoising steps
clones the prefix KV cache of every layer, builds masks from Python lists (a blocking
host-to-device copy per step) and runs eager attention; the GPU idles between thousands of small
launches.

What this does instead, with lerobot's own layer modules (attention, MLPs, AdaRMS norms,
rotary embeddings, projections), so loaded checkpoints and LoRA folding apply unchanged:

- the prefix (SigLIP + PaliGemma) runs once per call and its per-layer keys and values are
  kept by :class:`_PrefixKV`, a minimal stand-in for transformers' cache that each denoising
  step reads (prefix ⊕ suffix) without copying the cache;
- masks, positions and flow times are tensors built on the device, with no host round trip;
- attention is SDPA (``_attn_implementation="sdpa"``) with an additive mask in the model's
  dtype (a boolean mask would turn fully padded prompt rows into NaN), except where few queries
  meet many keys (a denoising step's 51 queries against the prefix): there :func:`mqa_attention`
  runs all heads that share a key/value head as one GEMM (Gemma's 8 query heads share 1), which
  the memory-efficient kernel runs as a few thread blocks, most of a large GPU's SMs idle;
- the cameras go through SigLIP in one batch when their shapes match;
- on a GPU the whole call (prefix + every Euler step) is captured once per batch size in
  ``buckets`` into a CUDA graph over static input buffers, after warm-up; a request is padded
  to the next bucket and sliced back. Replays read the parameters in place, so new weights
  and folded adapters (``LoRAServing`` copies into the same tensors) need no recapture; a
  change of the adapter fold state (different modules) does recapture. The capture, static
  buffers and padding (:meth:`FastPiSampler._graphed`) take any computation of named inputs to
  several outputs: plain sampling here, the flow-RL chain in :mod:`agents.policies.pi0.fast_chain`
  (which also needs each step's action-token features: ``velocity(..., features=True)``).

With ``compile`` (``policy.fast_compile``: ``auto`` compiles on a GPU), SigLIP, the prefix layer
stack and one denoising step run through ``torch.compile`` inside the graph. In ``"dynamic"``
mode (the default) the batch dimension (for batches >= 2) and the prefix length are symbolic
(:mod:`agents.policies.fast_common`), so one compile serves every bucket from 2 up and every
prompt length (batch 1 is always specialised by dynamo: a second compile), and each further
bucket or prompt length costs only a capture; ``"static"`` compiles each shape on its own.
Prompts are padded only to the batch's longest, rounded up (``policy.prompt_pad_multiple``,
:mod:`agents.policies.pi0.prompt`), not to lerobot's 48 / 200 tokens. Compiled kernels go to a
persistent inductor cache (``TORCHINDUCTOR_CACHE_DIR``, default ``~/.cache/tandem/inductor``),
so a restart mostly reads them back. ``Pi0Policy.warm_up`` compiles and captures the buckets a
server will use before it serves.

The result equals lerobot's ``sample_actions`` on the same noise: to float32 round-off on a
CPU (tests/test_pi0_fast.py), within bf16 tolerance on a GPU (the GPU test in the same file).
Levers, arguments of the sampler that are off unless given (:mod:`agents.policies.pi0.fast_levers`,
:mod:`agents.policies.pi0.fast_fused`, :mod:`agents.policies.pi0.fast_attention`; with all off none
of their code runs; the policy's defaults pass bf16 vision, ``fuse="all"`` and ``step_kv`` on a GPU):
``vision_dtype=torch.bfloat16`` runs SigLIP and the projector from a bf16 copy, ``expert_fp8``
the expert's step linears in FP8 e4m3 (``torch._scaled_mm``, row-wise scales), ``fuse``
("expert" or "all") stacks each layer's q/k/v and gate/up weights into one GEMM each,
``autotune`` compiles with inductor's GEMM autotuning, ``step_kv`` keeps the steps' keys/values
in per-call buffers, ``step_attention`` ("flex" or "triton") runs the steps' attention as fused
kernels (FlexAttention or Triton) and
``fuse_vision`` stacks SigLIP's q/k/v weights into one GEMM per layer,
``prefix_attention="cudnn"`` runs the prefix pass's attention, and SigLIP's in passes of
``CUDNN_MIN_IMAGES`` images or more, as cuDNN's fused attention op, ``inductor`` adds options to
the compiles, ``step_layers="triton"`` runs the expert's decoder layers in the steps as Triton
kernels (:mod:`agents.policies.pi0.fast_step_layers`; with ``step_kv``); :meth:`FastPiSampler.sync_weights` refreshes the levers' copies in place before
each call.
RTC (real-time chunking, :mod:`agents.policies.pi0.rtc`): ``sample(..., rtc=...)`` with per-row
tensors (the normalised pending prefix, lerobot's prefix weights, the frozen steps) guides each
Euler step as lerobot's ``RTCProcessor`` does and freezes the delayed steps; a batch of mixed
delays (and rows without RTC, all-zero weights) runs one graph, captured once per bucket for
RTC batches beside the plain one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from torch import nn

from agents.policies.fast_common import (CACHE_DIR, compile_mode, compiled_graphs, copy_inputs, gpu_kernels,
                                         input_signature, mark_dynamic, padded_inputs, prepare_compile,
                                         static_shapes_only)
from agents.policies.fast_aot import AotFunctions
from agents.policies.pi0.fast_stages import ada_layers, embed_images, plain_layers, vlm_prefix
from agents.policies.pi0.fast_attention import (ATTN_NAME, CUDNN_NAME, FLEX_NAME, StepKV, _PrefixKV,
                                                _register_attention)
from agents.policies.pi0.fast_levers import Levers
from agents.policies.pi0.fast_step_layers import StepLayers
from agents.policies.stand_ins import nested
from agents.policies.pi0.fast_triton import TRITON_NAME, triton_step_attention
from agents.policies.pi0.rtc import freeze, guide

#: the per-row RTC tensors ``sample`` takes: prefix [B, H, D], weights [B, H, 1], frozen [B, H, 1]
RTC_KEYS = ("rtc_prefix", "rtc_weights", "rtc_frozen")
#: ``step_attention`` -> the attention interface the denoising steps run (fast_attention.py)
STEP_ATTENTION = {"mqa": ATTN_NAME, "flex": FLEX_NAME, "triton": TRITON_NAME}

log = logging.getLogger("tandem.policies.pi0_fast")

#: ``prefix_attention="cudnn"``: SigLIP passes of this many images or more run cuDNN's attention
#: (fewer: SDPA's memory-efficient kernel, faster there at PI0's shapes; docs/benchmarks.md)
CUDNN_MIN_IMAGES = 4

#: served batch sizes a graph is captured for (a request pads up to the next one)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

class FastPiSampler:
    """``sample(images, img_masks, tokens, lang_masks, [state], noise) -> actions`` for a
    lerobot ``PI0Pytorch`` / ``PI05Pytorch`` (``variant`` "pi0" / "pi05"). ``graphs``: capture
    CUDA graphs (only on a CUDA device); without, the same computation runs eagerly."""

    def __init__(self, model: nn.Module, variant: str, *, graphs: bool = True,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, compile: bool | str | None = False,
                 cache_dir: str | None = CACHE_DIR, vision_dtype: torch.dtype | None = None,
                 expert_fp8: str | None = None, fuse: str | None = None, autotune: bool = False,
                 step_kv: bool = False, step_attention: str = "mqa", prefix_attention: str = "default",
                 inductor: dict | None = None, step_layers: str = "default", step_layers_max_rows: int | None = None,
                 fuse_vision: bool = False, aot_dir: str | None = None):
        if variant not in ("pi0", "pi05"):
            raise ValueError(f"FastPiSampler: variant must be pi0 or pi05, got {variant!r}")
        _register_attention((TRITON_NAME, triton_step_attention))
        self.model, self.variant = model, variant
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.graphs = bool(graphs)
        pwe = model.paligemma_with_expert
        self.vlm = pwe.paligemma.model.language_model
        self.expert = pwe.gemma_expert.model
        self.chunk = int(model.config.chunk_size)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, tuple[torch.Tensor, ...]]] = {}
        self.step_kv = bool(step_kv)  # the steps' keys/values in per-call buffers (fast_attention.StepKV)
        if step_attention not in STEP_ATTENTION:
            raise ValueError(f"FastPiSampler: step_attention must be one of {sorted(STEP_ATTENTION)}, got {step_attention!r}")
        self.step_attention = step_attention  # the denoising steps' attention (fast_attention.py)
        if prefix_attention not in ("default", "cudnn"):
            raise ValueError(f"FastPiSampler: prefix_attention must be default or cudnn, got {prefix_attention!r}")
        self.prefix_attention = prefix_attention  # SigLIP's and the prefix pass's attention kernel
        if step_layers not in ("default", "triton") or (step_layers == "triton" and (not step_kv or expert_fp8)):
            raise ValueError("FastPiSampler: step_layers must be default, or triton with step_kv and without "
                             f"expert_fp8; got {step_layers!r} (step_kv={step_kv}, expert_fp8={expert_fp8})")
        # the expert's decoder layers as Triton kernels in the steps (fast_step_layers.py)
        # (``step_layers_max_rows``: only for calls of at most that many rows, batch x suffix)
        self.step_layers = StepLayers(self.expert, step_layers_max_rows) if step_layers == "triton" else None
        self._vision_cfgs = list({id(m.config): m.config for m in pwe.paligemma.model.vision_tower.modules()
                                  if hasattr(m, "config") and hasattr(m, "is_causal")}.values())
        self._pool = None
        self.captures = 0  # graphs captured so far (tests and the bench read it)
        self.compiles = 0  # graphs dynamo compiled during those captures
        # torch.compile of one denoising step and of the prefix's two stages (SigLIP per camera,
        # the VLM layer stack): fuses the norms, rotary, residuals, the elementwise kernels
        # that remain once launches are gone; captured inside the graph like the eager code.
        # "dynamic": dynamic=None with only the batch and prefix length marked (automatic
        # dynamic off, so nothing else turns symbolic); "static": dynamic=False, one per shape
        self.compile = mode = compile_mode(compile, "FastPiSampler")
        if mode:
            prepare_compile(cache_dir)
        dyn = None if mode == "dynamic" else False
        # autotune (policy.fast_autotune): inductor benchmarks Triton GEMM templates against
        # cuBLAS per shape and fuses elementwise epilogues into the chosen template (longer
        # compiles; the choices persist in the inductor cache and the compile artefacts)
        self.autotune = bool(autotune and mode)
        # ``inductor``: more of inductor's options for these compiles (benchmarks: combo kernels,
        # coordinate-descent tuning of the Triton kernels' configs)
        opts = {**({"max_autotune": True} if self.autotune else {}), **(inductor or {})} or None

        def comp(fn):
            return torch.compile(fn, dynamic=dyn, options=opts) if mode else fn

        self._velocity, self._embed_image, self._prefix_kv = (
            comp(self.velocity), comp(pwe.embed_image), comp(self.prefix_kv))
        # opt-in levers (agents/policies/pi0/fast_levers.py, fast_fused.py): SigLIP in bf16, the
        # expert's step linears in FP8, stacked q/k/v and gate/up GEMMs; None (all off): the
        # computation above, untouched
        self.levers = (Levers(model, vision_dtype, expert_fp8, fuse, fuse_vision)
                       if vision_dtype or expert_fp8 or fuse or fuse_vision else None)
        # policy.fast_aot_dir: the prefix's two stages (SigLIP, the VLM stack) compiled ahead of
        # time, loaded by a later start without tracing (agents/policies/fast_aot.py); the
        # denoising step stays torch.compile'd (it reads the prefix cache's objects)
        self.aot: dict[str, AotFunctions] | None = None
        self._lever_key = (str(vision_dtype), expert_fp8, fuse, bool(fuse_vision), prefix_attention)
        self._call_key: Any = None
        if mode and aot_dir:
            desc = repr(model.config)
            dyn_aot = mode == "dynamic"
            self.aot = {"vision": AotFunctions(embed_images, aot_dir, f"{variant}-vision", desc, dynamic=dyn_aot,
                                               fallback=lambda _m, images: self._embed_image(images)),
                        "prefix": AotFunctions(vlm_prefix, aot_dir, f"{variant}-prefix", desc, dynamic=dyn_aot,
                                               fallback=lambda _m, embs, pad: self._prefix_kv(embs, pad))}

    # -- the computation (eager; captured as is) ---------------------------------------------------
    def _layers(self, lm: nn.Module, hidden: torch.Tensor, mask2d: torch.Tensor, pos: torch.Tensor,
                cache: _PrefixKV | StepKV, mods: list[torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``lm``'s decoder layers over ``hidden``. ``mods`` (PI0.5's expert): each AdaRMS
        norm's modulation, [1, 3 * width], in :meth:`modulations`' order; the layers then run
        lerobot's decoder-layer arithmetic with those given, and the final norm is applied.
        ``mask``: the additive mask, when built already (else from ``mask2d``)."""
        if mods is None:
            return plain_layers(lm, hidden, mask2d, pos, cache, mask)
        return ada_layers(lm, hidden, mask2d, pos, cache, mods, mask)

    def prefix(self, images, img_masks, tokens, lang_masks) -> tuple[_PrefixKV, torch.Tensor]:
        """The VLM pass: each layer's keys/values, and the prefix pad mask [B, P]."""
        pwe = self.model.paligemma_with_expert
        embs, pads = [], []
        dyn = self.compile == "dynamic"  # symbolic: batch (>= 2: dynamo's rule) and prompt length
        with self._swapped("vision"):
            if len(images) > 1 and len({tuple(i.shape) for i in images}) == 1:  # one SigLIP pass
                cat = torch.cat(list(images), dim=0)
                if dyn:
                    mark_dynamic((0,), cat)
                with self._vision_attention(cat.shape[0]):
                    feats = self._vision(cat).chunk(len(images), dim=0)
            else:
                if dyn:
                    mark_dynamic((0,), list(images))
                feats = []
                for img in images:
                    with self._vision_attention(img.shape[0]):
                        feats.append(self._vision(img))
        for e, m in zip(feats, img_masks, strict=True):
            embs.append(e)
            pads.append(m[:, None].expand(e.shape[0], e.shape[1]))
        embs.append(pwe.embed_language_tokens(tokens))
        pads.append(lang_masks)
        embs, pad = torch.cat(embs, dim=1), torch.cat(pads, dim=1)
        # every prefix token has ar-mask 0: full attention among the valid tokens
        self._set_attn(ATTN_NAME)
        if self.prefix_attention == "cudnn":
            self.vlm.config._attn_implementation = CUDNN_NAME  # noqa: SLF001
        cache = _PrefixKV(len(self.vlm.layers))
        if dyn:
            mark_dynamic((0, 1), embs, pad)
        with self._swapped("vlm"):
            if self.aot is not None:
                key = (embs.shape[0] == 1, self._call_key, self._lever_key, str(embs.dtype))
                k, v = self.aot["prefix"](key, self.vlm, embs, pad)
                cache.k, cache.v = list(k), list(v)
            else:
                cache.k, cache.v = self._prefix_kv(embs, pad)
        cache.recording = False
        return cache, pad

    @contextlib.contextmanager
    def _vision_attention(self, images: int):
        """``prefix_attention="cudnn"``: SigLIP's attention runs :func:`cudnn_attention` inside,
        where the pass holds ``CUDNN_MIN_IMAGES`` images or more (fewer: SDPA's kernel); the
        setting is restored after. Compiled, it is read when the stage traces (dynamo guards on
        it: a graph per setting)."""
        if self.prefix_attention == "default" or images < CUDNN_MIN_IMAGES:
            yield
            return
        old = [c._attn_implementation for c in self._vision_cfgs]  # noqa: SLF001
        for c in self._vision_cfgs:
            c._attn_implementation = CUDNN_NAME  # noqa: SLF001
        try:
            yield
        finally:
            for c, impl in zip(self._vision_cfgs, old, strict=True):
                c._attn_implementation = impl  # noqa: SLF001

    def _vision(self, images: torch.Tensor) -> torch.Tensor:
        """SigLIP + projector over ``images`` [N, C, H, W]: the ahead-of-time function when there
        is one, else the compiled (or eager) ``embed_image``."""
        if self.aot is None:
            return self._embed_image(images)
        n = images.shape[0]
        cudnn = self.prefix_attention != "default" and n >= CUDNN_MIN_IMAGES
        key = (n == 1, self._call_key, self._lever_key, cudnn, str(images.dtype))
        return self.aot["vision"](key, self.model.paligemma_with_expert.paligemma.model, images)

    def prefix_kv(self, embs: torch.Tensor, pad: torch.Tensor) -> tuple[list, list]:
        """The VLM layer stack over the prefix embeddings: each layer's keys and values."""
        return vlm_prefix(self.vlm, embs, pad)

    def _time_emb(self, t: torch.Tensor) -> torch.Tensor:
        """lerobot's sinusoidal embedding of the flow times ``t`` [N] -> [N, width]."""
        from lerobot.policies.common.vla_utils import create_sinusoidal_pos_embedding

        m = self.model
        return create_sinusoidal_pos_embedding(t, m.action_in_proj.out_features, min_period=m.config.min_period,
                                               max_period=m.config.max_period, device=t.device).type(t.dtype)

    def _suffix(self, state, x_t, t) -> tuple[torch.Tensor, torch.Tensor]:
        """Suffix embeddings and the suffix's ar-mask (lerobot's embed_suffix, with the constant
        ar-mask built on the device; PI0.5's time condition is :meth:`modulations`)."""
        m = self.model
        action_emb = m.action_in_proj(x_t)
        if self.variant == "pi05":
            return action_emb, self._ar(x_t.device)
        time_emb = self._time_emb(t)
        if m.state_proj.weight.dtype == torch.float32:
            state = state.to(torch.float32)
        state_emb = m.state_proj(state)[:, None, :]
        te = time_emb[:, None, :].expand_as(action_emb)
        at = m.action_time_mlp_out(nn.functional.silu(m.action_time_mlp_in(torch.cat([action_emb, te], dim=2))))
        return torch.cat([state_emb, at], dim=1), self._ar(x_t.device)

    def _ar(self, device) -> torch.Tensor:
        """The suffix's ar-mask on the device (no host copy: capture): PI0's state token and
        first action token open blocks, PI0.5's first action token."""
        if self.variant == "pi05":
            return (torch.arange(self.chunk, device=device) < 1).float()
        return (torch.arange(self.chunk + 1, device=device) < 2).float()

    def modulations(self, times: torch.Tensor) -> list[torch.Tensor]:
        """PI0.5: every AdaRMS norm's ``dense(cond)`` for every flow time at once, [S, 3 * width]
        each (input and post-attention norm of each expert layer, then the final norm). The
        condition depends on the time alone (the same for every row), so the 37 small GEMMs of
        each step become 37 for the whole call. With step layers, their shift biases follow."""
        m = self.model
        cond = nn.functional.silu(m.time_mlp_out(nn.functional.silu(m.time_mlp_in(self._time_emb(times)))))
        norms = [n for layer in self.expert.layers[: self.expert.config.num_hidden_layers]
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [self.expert.norm]
        mods = [n.dense(cond) for n in norms]
        if self.step_layers is not None:  # then each step layer's shift biases (fast_step_layers.py)
            mods += self.step_layers.shift_biases(mods)
        return mods

    def velocity(self, cache: _PrefixKV, pad: torch.Tensor, state, x_t: torch.Tensor, t: torch.Tensor,
                 mods: list[torch.Tensor] | None = None, features: bool = False):
        """One denoising step's velocity (lerobot's denoise_step); PI0.5: ``mods`` are this
        step's rows of :meth:`modulations`. ``features``: (velocity, the expert's action-token
        features [B, chunk, width] in float32, what ``action_out_proj`` reads)."""
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        embs, ar = self._suffix(state, x_t, t)
        b, s = embs.shape[:2]
        pos = pad.sum(dim=-1, keepdim=True) + torch.arange(s, device=embs.device)[None]
        if isinstance(cache, StepKV):  # the mask of every step, built once a call
            h = self._layers(self.expert, embs, None, pos, cache, mods, mask=cache.mask)
        else:
            ones = torch.ones(b, s, dtype=torch.bool, device=embs.device)
            mask2d = torch.cat([pad[:, None, :].expand(b, s, pad.shape[1]),
                                make_att_2d_masks(ones, ar[None].expand(b, s))], dim=2)
            h = self._layers(self.expert, embs, mask2d, pos, cache, mods)
        if mods is None:
            h, _ = self.expert.norm(h, None)
        feat = h[:, -self.chunk:].to(torch.float32)
        v = self.model.action_out_proj(feat)
        return (v, feat) if features else v

    def _steps(self, images, img_masks, tokens, lang_masks, state, noise: torch.Tensor, num_steps: int):
        """What every Euler step reads: the prefix pass (its KV stand-in and pad mask), the flow
        times t_k = 1 + k dt [num_steps] and, for PI0.5, each time's AdaRMS modulations."""
        cache, pad = self.prefix(images, img_masks, tokens, lang_masks)
        if self.step_kv:
            ar = self._ar(noise.device)
            cache = StepKV(cache, pad, len(ar), ar, self.expert.layers[0].self_attn.q_proj.weight.dtype)
        self._set_attn(STEP_ATTENTION[self.step_attention])
        dt = -1.0 / num_steps
        times = 1.0 + dt * torch.arange(num_steps, dtype=torch.float32, device=noise.device)
        mods = self.modulations(times) if self.variant == "pi05" else None
        if self.compile == "dynamic":  # the same tensors every step
            mark_dynamic((0, 2), cache.k, cache.v)  # [B, heads, prefix (+ suffix) length, D]
            if self.step_kv:
                mark_dynamic((0, 3), cache.mask)  # [B, 1, suffix, keys]
            mark_dynamic((0, 1), pad)
            mark_dynamic((0,), state)
        return cache, pad, times, mods

    def _step_velocity(self, cache, pad, state, x, times, mods, step: int, features: bool = False):
        """Euler step ``step``'s velocity at ``x`` (:meth:`velocity`, compiled where set)."""
        t = times[step].expand(x.shape[0])
        if self.compile == "dynamic":
            mark_dynamic((0,), x, t)
        with self._swapped("expert"):
            return self._velocity(cache, pad, state, x, t, None if mods is None else [m[step:step + 1] for m in mods],
                                  features=features)

    def _swapped(self, what: str):
        """The levers' stand-ins ("vision": bf16 SigLIP, "expert": the step layers, FP8 linears or fused
        projections, "vlm": the VLM's fused projections) while inside."""
        if what == "expert" and self.step_layers is not None and self.step_layers.sites:
            # the levers' expert stand-ins too, inside the layers (after the step layers' check of
            # them), for the calls the kernels do not take
            return nested(self.step_layers.swapped(), self.levers.expert_swapped() if self.levers else None)
        if self.levers is None:
            return contextlib.nullcontext()
        return {"vision": self.levers.vision_swapped, "expert": self.levers.expert_swapped,
                "vlm": self.levers.vlm_swapped}[what]()

    def sync_weights(self, force: bool = False) -> None:
        """Before a call, outside any graph: the levers' copies of weights written since (in
        place: the graphs read them). Nothing without levers (the graphs read the parameters)."""
        for part in (self.levers, self.step_layers):
            if part is not None:
                part.sync(force)

    def _sample(self, images, img_masks, tokens, lang_masks, state, noise, num_steps: int,
                rtc: dict | None = None, gws: tuple[float, ...] = ()) -> torch.Tensor:
        with gpu_kernels(noise.is_cuda):
            cache, pad, times, mods = self._steps(images, img_masks, tokens, lang_masks, state, noise, num_steps)
            dt, x = -1.0 / num_steps, noise
            for step in range(num_steps):
                v = self._step_velocity(cache, pad, state, x, times, mods, step)
                if rtc is None:
                    x = x + dt * v
                    continue
                # RTC (agents/policies/pi0/rtc.py): lerobot's guidance at its time 1 + step * dt,
                # then the frozen steps set to the noisy prefix of the next time (0 at the end)
                time_ = 1.0 + step * dt
                x = x + dt * guide(v, x, time_, gws[step], rtc["rtc_prefix"], rtc["rtc_weights"])
                t_next = 0.0 if step == num_steps - 1 else 1.0 + (step + 1) * dt
                x = freeze(x, t_next, noise, rtc["rtc_prefix"], rtc["rtc_frozen"])
            return x

    def _set_attn(self, impl: str) -> None:
        # lerobot's eager path sets "eager" on each call; these configs are read per forward
        for lm in (self.vlm, self.expert):
            lm.config._attn_implementation = impl  # noqa: SLF001

    # -- serving -----------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, images, img_masks, tokens, lang_masks, state, noise: torch.Tensor,
               num_steps: int, *, key: Any = None, rtc: dict | None = None,
               guidance: tuple[float, ...] = (), prep=None) -> torch.Tensor:
        """Actions [B, chunk, max_action_dim]. ``key``: anything that changes which modules run
        (the adapter fold state): graphs are kept per (batch bucket, key). ``rtc``: the
        :data:`RTC_KEYS` tensors of every row, with ``guidance`` the guidance weight of each
        Euler step (:func:`agents.policies.pi0.rtc.guidance_weights`). ``prep``: ``images`` are the
        cameras' frames as they came and ``prep(images) -> (images, img_masks)`` the policy's
        mapping to the model's, run inside the graph (its kernels launched by a replay, not one by one)."""
        if rtc is not None and len(guidance) != num_steps:
            raise ValueError(f"RTC needs a guidance weight per Euler step ({num_steps}), got {len(guidance)}")
        gws = tuple(float(g) for g in guidance) if rtc is not None else ()
        self._call_key = key  # (the ahead-of-time functions' keys name it: the adapters' fold state)
        self.sync_weights()
        if not (self.graphs and noise.is_cuda) or self.bucket(noise.shape[0]) is None:  # no graph: eager
            images, img_masks = prep(images) if prep is not None else (images, img_masks)
            return self._sample(images, img_masks, tokens, lang_masks, state, noise, num_steps, rtc, gws)
        inputs = {"images": list(images), "img_masks": None if prep is not None else list(img_masks),
                  "tokens": tokens, "lang_masks": lang_masks, "state": state, "noise": noise, **(rtc or {})}

        def run(s: dict) -> tuple[torch.Tensor]:
            r = {k: s[k] for k in RTC_KEYS} if gws else None
            ims, masks = prep(s["images"]) if prep is not None else (s["images"], s["img_masks"])
            return (self._sample(ims, masks, s["tokens"], s["lang_masks"], s["state"], s["noise"], num_steps, r, gws),)

        what = f"{num_steps} steps{', RTC' if gws else ''}{', frames' if prep is not None else ''}"
        return self._graphed((num_steps, key, gws, prep is not None), inputs, run, what)[0]

    def bucket(self, b: int) -> int | None:
        """The captured batch size a request of ``b`` rows is padded to (None: beyond them)."""
        return next((x for x in self.buckets if x >= b), None)

    def _graphed(self, key: tuple, inputs: dict, run, what: str) -> tuple[torch.Tensor, ...]:
        """``run(inputs)`` through a CUDA graph: ``inputs`` (tensors, lists of tensors or None;
        batch first, ``inputs["noise"]`` gives the batch) are copied into static buffers of the
        batch's bucket, the graph of (bucket, ``key``, the inputs' signature) is replayed (captured
        over ``run(static buffers)`` on first use) and each of ``run``'s outputs (batch first) is
        returned cut to the request's rows. ``key`` must name everything else that changes the
        computation; ``run`` must read tensors only from the dict it is given."""
        b = inputs["noise"].shape[0]
        bucket = self.bucket(b)
        gkey = (bucket, key, input_signature(inputs))
        if gkey not in self._graphs:
            # static buffers and the graph's tensors are normal tensors even when the first call
            # comes under inference_mode (later calls may come under no_grad, and copy into them)
            with torch.inference_mode(False), torch.no_grad():
                self._graphs[gkey] = self._capture(padded_inputs(inputs, bucket), run, what)
        graph, static, outs = self._graphs[gkey]
        copy_inputs(static, inputs, b)
        graph.replay()
        return tuple(o[:b].clone() for o in outs)

    def _capture(self, static: dict, run, what: str):
        def call():
            with static_shapes_only():
                return tuple(run(static))

        t0, graphs0 = time.perf_counter(), compiled_graphs()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits, cuBLAS workspaces, autotuning
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the learner's other threads may use CUDA meanwhile (a training step, whose
        # allocations or event waits a global-mode capture would refuse), as in OFT's fast path;
        # a staged warm-up (learner/warmup.py) captures on the serving thread while training runs
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outs = call()
        self.captures += 1
        new = compiled_graphs() - graphs0
        self.compiles += new
        log.info("PI fast path: captured a CUDA graph for batch %d (%s) in %.1f s%s",
                 static["noise"].shape[0], what, time.perf_counter() - t0,
                 f", {new} graph(s) compiled ({self.compile})" if self.compile else "")
        return graph, static, outs

