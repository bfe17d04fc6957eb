"""Two opt-in precision levers of PI0's fast serving path (:mod:`agents.policies.pi0.fast`), off by
default; the training path (lerobot's modules as they are) never sees them.

**bf16 SigLIP** (``policy.fast_vision_dtype=bf16``, :class:`VisionCopy`). lerobot holds the vision
tower and the multi-modal projector in float32 whatever the model's precision
(``PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`` keeps ``vision_tower`` and
``multi_modal_projector`` float32; ``embed_image`` casts the images to float32), so on a GPU the
fast path runs SigLIP's GEMMs in TF32. With the lever the fast path keeps a bf16 copy of every
floating parameter of those two modules and swaps the copies in (``module._parameters``) around
its own SigLIP call only; SigLIP's patch embedding casts the pixels to its weight's dtype, so
the whole tower runs in bf16 (LayerNorm and softmax accumulate in float32 inside their kernels).

**FP8 action expert** (``policy.fast_expert_fp8=true``, :class:`Fp8Expert`). The denoising steps'
GEMMs have ~51 rows per observation and are bound by reading the expert's weights, once per
step. With the lever each of the expert's seven linear layers per decoder layer (q/k/v/o, gate,
up, down) is replaced, around the fast path's velocity call only, by an FP8 stand-in
(:mod:`agents.policies.fp8`: e4m3 weights with per-channel scales, activations per row,
``torch._scaled_mm``; ``emulate`` for checks on any device; :func:`check_fp8` refuses it at
policy build where no FP8 GEMM can run).

**New weights.** The CUDA graphs read the bf16 copies and the FP8 buffers in place, as they read
the model's parameters. Before every call (outside the graph) :meth:`sync` compares each
source parameter's version counter (bumped by every in-place write through the parameter:
``copy_`` of a LoRA fold or unfold, ``load_trainable_state_dict``) and the module at each expert
site (folded Linear or live peft wrapper) with what was last copied, and refreshes what changed
into the same tensors: no recapture. Writes through ``.data`` bypass version counters and are
not seen (nothing in Tandem writes weights that way after construction); ``sync(force=True)``
refreshes everything.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from agents.policies.fp8 import FALSE_WORDS, TRUE_WORDS, Fp8Layers, check_fp8, resolve_fp8
from agents.policies.pi0.fast_fused import VISION_GROUPS, FusedProjections, resolve_fuse
from agents.policies.stand_ins import nested
from agents.policies.stand_ins import VERSION

log = logging.getLogger("tandem.policies.pi0_fast")



# -- settings -------------------------------------------------------------------------------------
def resolve_vision_dtype(value: Any, cuda: bool = False) -> torch.dtype | None:
    """``policy.fast_vision_dtype`` -> None (fp32: SigLIP as lerobot holds it) or torch.bfloat16;
    ``auto``: bf16 where the fast path runs on a GPU (``cuda``), fp32 elsewhere."""
    v = str(value).strip().lower()
    if v == "auto":
        return torch.bfloat16 if cuda else None
    if v in ("fp32", "float32"):
        return None
    if v in ("bf16", "bfloat16"):
        return torch.bfloat16
    raise ValueError(f"policy.fast_vision_dtype must be auto, fp32 or bf16, got {value!r}")


def resolve_expert_fp8(value: Any) -> str | None:
    """``policy.fast_expert_fp8`` -> None (off), "cuda" (torch._scaled_mm) or "emulate"."""
    return resolve_fp8(value, "policy.fast_expert_fp8")


def lever_settings(cfg, cuda: bool = False) -> dict:
    """A PI0 config's ``fast_vision_dtype`` / ``fast_expert_fp8`` / ``fast_fuse_proj`` /
    ``fast_autotune`` / ``fast_step_kv`` / ``fast_step_layers`` (off when absent) as :class:`FastPiSampler` arguments
    for a fast path on a GPU (``cuda``) or not: ``auto`` settings resolve by it (raises on a bad value: the config's validation
    calls it). An explicit FP8 expert turns ``fast_fuse_proj=auto`` off (both replace the
    expert's linear layers); an explicit fusion with FP8 is an error."""
    fp8 = resolve_expert_fp8(cfg.fast_expert_fp8)
    auto_fuse = str(cfg.fast_fuse_proj).strip().lower() == "auto"
    out = {"vision_dtype": resolve_vision_dtype(cfg.fast_vision_dtype, cuda), "expert_fp8": fp8,
           "fuse": None if auto_fuse and fp8 else resolve_fuse(cfg.fast_fuse_proj, cuda),
           "autotune": resolve_flag(cfg.fast_autotune, "policy.fast_autotune"),
           "step_kv": resolve_flag(getattr(cfg, "fast_step_kv", False), "policy.fast_step_kv", cuda),
           "step_layers": "triton" if resolve_flag(getattr(cfg, "fast_step_layers", False),
                                                   "policy.fast_step_layers") else "default"}
    if out["fuse"] and out["expert_fp8"]:
        raise ValueError("policy.fast_fuse_proj and policy.fast_expert_fp8 both replace the expert's linear "
                         "layers; set one of them")
    if out["step_layers"] != "default" and (out["expert_fp8"] or not out["step_kv"]):
        raise ValueError("policy.fast_step_layers needs policy.fast_step_kv on and policy.fast_expert_fp8 off")
    return out


def resolve_flag(value: Any, name: str, cuda: bool | None = None) -> bool:
    """A true / false setting -> bool (raises naming ``name`` on anything else); where ``cuda``
    is given, ``auto`` too: true where the fast path runs on a GPU."""
    v = str(value).strip().lower()
    if v == "auto" and cuda is not None:
        return cuda
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be {'auto, ' if cuda is not None else ''}true or false, got {value!r}")


def check_levers(cfg, device: torch.device, who: str) -> None:
    """At policy build: FP8 that cannot run fails now (:func:`check_fp8`); a lever that the
    serving path will not use (``fast_serving`` off, or auto on a CPU) is said once."""
    s = lever_settings(cfg)  # as on a CPU: ``auto`` settings are off, only explicit ones are said
    if s["expert_fp8"] == "cuda":
        check_fp8(device)
    unused = cfg.fast_serving == "off" or (cfg.fast_serving == "auto" and device.type != "cuda")
    if unused and (s["vision_dtype"] is not None or s["expert_fp8"] is not None or s["fuse"] or s["autotune"]
                   or s["step_kv"]):
        log.warning("%s: fast_vision_dtype / fast_expert_fp8 / fast_fuse_proj / fast_autotune / fast_step_kv act on "
                    "the fast serving path only, which fast_serving=%s does not use here (RTC acts still take it)",
                    who, cfg.fast_serving)


class Fp8Expert(Fp8Layers):
    """The FP8 stand-ins of the expert's step linears (:mod:`agents.policies.fp8`): :meth:`sync`
    before a call, :meth:`swapped` around the velocity computation (eager, warm-up and capture)."""

    def __init__(self, expert: nn.Module, mode: str):
        super().__init__(expert.layers[: expert.config.num_hidden_layers], mode, what="FP8 expert",
                         setting="policy.fast_expert_fp8")  # every decoder linear the steps run


class VisionCopy:
    """A ``dtype`` copy of every floating parameter of ``roots`` (SigLIP and the projector),
    swapped in around the fast path's image embedding (module docstring)."""

    def __init__(self, roots: list[nn.Module], dtype: torch.dtype):
        self.roots, self.dtype = roots, dtype
        self.copies: dict[int, tuple[torch.Tensor, nn.Parameter, list[int]]] = {}  # id(src) -> (src, copy, [version])
        self._srcs: list[torch.Tensor] = []
        self._versions: list[int] = []
        for root in roots:
            for p in root.parameters():
                self._copy_of(p)
        self.refreshed = 0  # parameters re-copied by sync

    def _copy_of(self, p: torch.Tensor) -> nn.Parameter:
        hit = self.copies.get(id(p))
        if hit is not None and hit[0] is p:
            return hit[1]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("bf16 vision: a parameter without a copy during a CUDA graph capture")
        with torch.inference_mode(False), torch.no_grad():
            c = nn.Parameter(p.detach().to(self.dtype, copy=True), requires_grad=False)
        self.copies[id(p)] = (p, c, [p._version])  # noqa: SLF001
        self._srcs.append(p)
        self._versions.append(p._version)  # noqa: SLF001
        return c

    def sync(self, force: bool = False) -> int:
        """Re-copy, in place, each parameter written since its last copy; how many."""
        if not force and list(map(VERSION, self._srcs)) == self._versions:
            return 0  # the per-call case
        n = 0
        with torch.inference_mode(False), torch.no_grad():
            for src, c, ver in self.copies.values():
                if force or src._version != ver[0]:  # noqa: SLF001
                    c.copy_(src)
                    ver[0] = src._version  # noqa: SLF001
                    n += 1
        self._versions = list(map(VERSION, self._srcs))
        self.refreshed += n
        return n

    @contextlib.contextmanager
    def swapped(self):
        """The copies in the modules' parameter slots; the originals back after."""
        done = []
        try:
            for root in self.roots:
                for mod in root.modules():
                    for name, p in list(mod._parameters.items()):  # noqa: SLF001
                        if p is None or not p.is_floating_point():
                            continue
                        mod._parameters[name] = self._copy_of(p)  # noqa: SLF001
                        done.append((mod, name, p))
            yield
        finally:
            for mod, name, p in done:
                mod._parameters[name] = p  # noqa: SLF001


class Levers:
    """What :class:`agents.policies.pi0.fast.FastPiSampler` holds of the levers: the bf16 vision
    copy, the FP8 expert or the fused projections (:mod:`agents.policies.pi0.fast_fused`: the
    expert's, and with ``fuse="all"`` the VLM's), synced before each call."""

    def __init__(self, model: nn.Module, vision_dtype: torch.dtype | None, expert_fp8: str | None,
                 fuse: str | None = None, fuse_vision: bool = False):
        pwe = model.paligemma_with_expert
        self.vision = self.fp8 = self.fused_expert = self.fused_vlm = self.fused_vision = None
        fuse = resolve_fuse(fuse)
        if fuse and expert_fp8:
            raise ValueError("the fused projections and the FP8 expert both replace the expert's linear layers")
        if fuse:
            self.fused_expert = FusedProjections(_decoder_layers(pwe.gemma_expert.model), "expert")
        if fuse == "all":
            self.fused_vlm = FusedProjections(_decoder_layers(pwe.paligemma.model.language_model), "VLM")
        if fuse_vision:  # SigLIP's q/k/v, stacked in the dtype SigLIP runs in (vision_dtype's copy or its own)
            self.fused_vision = FusedProjections(list(pwe.paligemma.model.vision_tower.vision_model.encoder.layers),
                                                 "vision", VISION_GROUPS, vision_dtype)
        if vision_dtype is not None:
            pm = pwe.paligemma.model
            self.vision = VisionCopy([pm.vision_tower, pm.multi_modal_projector], vision_dtype)
        if expert_fp8 is not None:
            if expert_fp8 == "cuda":
                check_fp8(model.action_out_proj.weight.device)
            self.fp8 = Fp8Expert(pwe.gemma_expert.model, expert_fp8)

    def sync(self, force: bool = False) -> None:
        if self.vision is not None:
            self.vision.sync(force)
        for part in (self.fp8, self.fused_expert, self.fused_vlm, self.fused_vision):
            if part is not None:
                part.sync(force)

    def vision_swapped(self):
        """The bf16 copies, then the fused q/k/v (their own copies) in SigLIP's layers."""
        return nested(self.vision.swapped() if self.vision is not None else None,
                      self.fused_vision.swapped() if self.fused_vision is not None else None)

    def expert_swapped(self):
        part = self.fp8 or self.fused_expert
        return part.swapped() if part is not None else contextlib.nullcontext()

    def vlm_swapped(self):
        return self.fused_vlm.swapped() if self.fused_vlm is not None else contextlib.nullcontext()


def _decoder_layers(lm: nn.Module) -> list[nn.Module]:
    return list(lm.layers[: lm.config.num_hidden_layers])
