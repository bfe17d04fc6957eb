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
up, down) is replaced, around the fast path's velocity call only, by an :class:`Fp8Linear`:
weights in float8 e4m3 with one float32 scale per output channel (``amax(|W[n, :]|) / 448``),
activations quantized per row at run time (``amax(|x[m, :]|) / 448``), and the product by
``torch._scaled_mm`` with row-wise scales (``scale_a`` [M, 1], ``scale_b`` [1, N], float32,
contiguous; mat1 row-major, mat2 column-major, K and N multiples of 16, bf16 out, no fast
accumulation): ``y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k]``. The weight quantized is
the layer's effective one: the folded weight, or base + LoRA (scale * B @ A, what peft adds)
where the adapters are live. Where the hardware or torch has no FP8 GEMM the option fails
when the policy is built (:func:`check_fp8`), never falls back: it is an explicit request for a
measured speed/precision trade, and a silent bf16 run would report bf16 numbers under the FP8
label. ``emulate`` runs the same quantization with the product as dequantize -> float32 matmul,
on any device (the CPU tests check the arithmetic with it).

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

from agents.policies.pi0.fast_fused import VISION_GROUPS, FusedProjections, resolve_fuse
from agents.policies.pi0.stand_ins import nested
from agents.policies.pi0.stand_ins import VERSION, Site, StandIns
from agents.policies.vla_common import effective_weight

log = logging.getLogger("tandem.policies.pi0_fast")

E4M3 = torch.float8_e4m3fn
#: the largest finite float8 e4m3fn value
E4M3_MAX = 448.0
#: floor of a row's amax before it becomes a scale (an all-zero row quantizes to zeros, no NaN)
AMAX_EPS = 1e-12
#: the expert's linear layers run by each denoising step, per decoder layer
EXPERT_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                  ("mlp", ("gate_proj", "up_proj", "down_proj")))
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "none", "null", "")


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
    v = str(value).strip().lower()
    if v in _FALSE:
        return None
    if v in _TRUE:
        return "cuda"
    if v == "emulate":
        return "emulate"
    raise ValueError(f"policy.fast_expert_fp8 must be false, true or emulate, got {value!r}")


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
    if v in _TRUE:
        return True
    if v in _FALSE:
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


def fp8_unavailable(device: torch.device | str) -> str | None:
    """Why row-wise FP8 GEMMs cannot run on ``device`` (None: they can; a tiny probe ran)."""
    dev = torch.device(device)
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn"
    if dev.type != "cuda":
        return f"the policy runs on {dev.type!r}; FP8 GEMMs need an NVIDIA GPU of compute capability 8.9 or later"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if cap < (8, 9):
        return f"{name} is sm_{cap[0]}{cap[1]}; FP8 GEMMs need compute capability 8.9 or later (L4, L40, H100, H200)"
    try:  # the row-wise kernel is a build option of torch: ask it
        a = torch.ones(16, 16, device=dev).to(E4M3)
        s = torch.ones(16, 1, device=dev)
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return f"torch._scaled_mm with row-wise scales failed on {name} (torch {torch.__version__}): {exc}"
    return None


def check_fp8(device: torch.device | str) -> None:
    """Raise when ``policy.fast_expert_fp8=true`` cannot run on ``device``, saying why."""
    why = fp8_unavailable(device)
    if why:
        raise RuntimeError(f"policy.fast_expert_fp8=true: no FP8 GEMMs here: {why}. Set policy.fast_expert_fp8=false "
                           f"(or emulate: the same quantization through float32 matmuls, slow, for checks)")


# -- quantization -----------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row (last dim) of ``x`` to float8 e4m3 with its own float32 scale: (q [..., K] e4m3,
    scale [..., 1] float32) with ``x ~= q * scale``; a row's largest magnitude maps to 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / E4M3_MAX
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (scale broadcast over the rows of q)."""
    return q.float() * scale


class Fp8Linear(nn.Module):
    """A linear layer over float8 e4m3 weights with per-output-channel scales and activations
    quantized per row at run time (module docstring). ``emulate``: the product as float32
    matmul of the dequantized operands (any device) instead of ``torch._scaled_mm``."""

    def __init__(self, out_features: int, in_features: int, device: torch.device, out_dtype: torch.dtype,
                 emulate: bool, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.emulate = in_features, out_features, emulate
        self.register_buffer("qweight", torch.zeros(out_features, in_features, device=device).to(E4M3))
        self.register_buffer("wscale", torch.ones(1, out_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device, dtype=out_dtype) if bias else None)
        self._dtype_marker = torch.empty(0, device=device, dtype=out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """An empty tensor of the layer's compute dtype: what callers read ``.weight.dtype`` for
        (the fast path's ``_layers``, lerobot's layer code); using it as a weight fails loudly."""
        return self._dtype_marker

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize ``weight`` [N, K] into this layer's buffers in place (a graph reads them)."""
        q, s = quantize_rows(weight)
        self.qweight.copy_(q)
        self.wscale.copy_(s.view(1, -1))
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = quantize_rows(x.reshape(-1, self.in_features))
        if self.emulate:  # fp8 values are exact in float32 (and TF32): the GEMM's float32 sums, scales after
            y = ((xq.float() @ self.qweight.float().t()) * xs * self.wscale).to(x.dtype)
        else:
            y = torch._scaled_mm(xq.contiguous(), self.qweight.t(), scale_a=xs, scale_b=self.wscale,
                                 out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class _Site(Site):
    """One expert linear layer: where it sits, its FP8 stand-in, and what it was quantized from."""

    def __init__(self, parent: nn.Module, attr: str, fp8: Fp8Linear):
        self.parent, self.attr, self.fp8 = parent, attr, fp8
        self.refresh()

    def live(self) -> list[nn.Module]:
        return [self.parent._modules[self.attr]]  # noqa: SLF001

    def refresh(self) -> None:
        cur = self.parent._modules[self.attr]  # noqa: SLF001
        w, bias, srcs = effective_weight(cur)
        self.fp8.load(w, bias)
        self.bind([cur], srcs)

    def installed(self) -> bool:
        return self.live()[0] is self.fp8

    def install(self) -> None:
        self.parent._modules[self.attr] = self.fp8  # noqa: SLF001

    def restore(self) -> None:
        self.parent._modules[self.attr] = self.bound[0]  # noqa: SLF001


class Fp8Expert(StandIns):
    """The FP8 stand-ins of the expert's step linears (module docstring): :meth:`sync` before a
    call, :meth:`swapped` around the velocity computation (eager, warm-up and capture)."""

    def __init__(self, expert: nn.Module, mode: str):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"Fp8Expert: mode must be cuda or emulate, got {mode!r}")
        self.mode, sites, self.skipped = mode, [], []
        with torch.inference_mode(False), torch.no_grad():
            for i, layer in enumerate(expert.layers[: expert.config.num_hidden_layers]):
                for block, names in EXPERT_LINEARS:
                    parent = getattr(layer, block)
                    for attr in names:
                        cur = parent._modules[attr]  # noqa: SLF001
                        w, bias, _ = effective_weight(cur)
                        n, k = w.shape
                        if mode == "cuda" and (n % 16 or k % 16):  # torch._scaled_mm's alignment
                            self.skipped.append(f"layers.{i}.{block}.{attr} [{n}x{k}]")
                            continue
                        dtype = (cur.base_layer if hasattr(cur, "base_layer") else cur).weight.dtype
                        if mode == "cuda" and dtype != torch.bfloat16:
                            raise RuntimeError(f"policy.fast_expert_fp8=true needs the bf16 model (policy.dtype "
                                               f"bfloat16 or auto on a GPU); the expert's weights are {dtype}")
                        sites.append(_Site(parent, attr, Fp8Linear(n, k, w.device, dtype, mode == "emulate",
                                                                   bias is not None)))
        super().__init__(sites, "FP8 expert")
        log.info("PI fast path: FP8 (e4m3, %s) expert: %d linear layers%s", mode, len(self.sites),
                 f", kept in {len(self.skipped)} (dims not multiples of 16): {self.skipped[:4]}" if self.skipped else "")

    @property
    def requantized(self) -> int:
        """Layers re-quantized by sync (tests and logs read it)."""
        return self.refreshed


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
