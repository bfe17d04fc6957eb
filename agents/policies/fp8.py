"""FP8 linear layers for the fast serving paths: PI0's action expert (``policy.fast_expert_fp8``,
:mod:`agents.policies.pi0.fast_levers`) and OpenVLA-OFT's Llama layers (``policy.fast_llm_fp8``,
:mod:`agents.policies.openvla_oft.fast`). Off by default; the training path never sees them.

Each chosen linear layer of each decoder layer is replaced, around the fast path's own call
only, by an :class:`Fp8Linear`: weights in float8 e4m3 with one float32 scale per output channel
(``amax(|W[n, :]|) / 448``), activations quantized per row at run time (``amax(|x[m, :]|) /
448``), and the product by ``torch._scaled_mm`` with row-wise scales (``scale_a`` [M, 1],
``scale_b`` [1, N], float32, contiguous; mat1 row-major, mat2 column-major, K and N multiples of
16, bf16 out, no fast accumulation): ``y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k]``. The
weight quantized is the layer's effective one: the folded weight, or base + LoRA (scale * B @ A,
what peft adds) where the adapters are live. Where the hardware or torch has no FP8 GEMM the
setting fails when the policy is built (:func:`check_fp8`), never falls back: it is an explicit
request for a measured speed/precision trade, and a silent bf16 run would report bf16 numbers
under the FP8 label. ``emulate`` runs the same quantization with the product as dequantize ->
float32 matmul, on any device (the CPU tests check the arithmetic with it).

**New weights.** A CUDA graph reads the FP8 buffers in place, as it reads the model's
parameters. Before every call (outside the graph) :meth:`Fp8Layers.sync` compares each source
parameter's version counter (bumped by every in-place write through the parameter: ``copy_`` of
a LoRA fold or unfold, ``load_trainable_state_dict``) and the module at each site (folded Linear
or live peft wrapper) with what was last quantized, and re-quantizes what changed into the same
tensors: no recapture (:mod:`agents.policies.stand_ins`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from agents.policies.stand_ins import Site, StandIns
from agents.policies.vla_common import effective_weight

log = logging.getLogger("tandem.policies.fp8")

E4M3 = torch.float8_e4m3fn
#: the largest finite float8 e4m3fn value
E4M3_MAX = 448.0
#: floor of a row's amax before it becomes a scale (an all-zero row quantizes to zeros, no NaN)
AMAX_EPS = 1e-12
#: the linear layers of a Gemma / Llama decoder layer: (block, attributes)
DECODER_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                   ("mlp", ("gate_proj", "up_proj", "down_proj")))
#: the words a true / false setting may be (any case)
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "none", "null", "")


def resolve_fp8(value: Any, setting: str) -> str | None:
    """A ``false`` / ``true`` / ``emulate`` setting -> None (off), "cuda" (torch._scaled_mm) or
    "emulate" (raises naming ``setting`` on anything else)."""
    v = str(value).strip().lower()
    if v in FALSE_WORDS:
        return None
    if v in TRUE_WORDS:
        return "cuda"
    if v == "emulate":
        return "emulate"
    raise ValueError(f"{setting} must be false, true or emulate, got {value!r}")


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


def check_fp8(device: torch.device | str, setting: str = "policy.fast_expert_fp8") -> None:
    """Raise when ``setting=true`` cannot run on ``device``, saying why."""
    why = fp8_unavailable(device)
    if why:
        raise RuntimeError(f"{setting}=true: no FP8 GEMMs here: {why}. Set {setting}=false "
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
        (the fast paths' layer loops, lerobot's layer code); using it as a weight fails loudly."""
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
    """One linear layer: where it sits, its FP8 stand-in, and what it was quantized from."""

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


class Fp8Layers(StandIns):
    """The FP8 stand-ins of ``linears`` (:data:`DECODER_LINEARS`) in each of ``layers``
    (module docstring): :meth:`sync` before a call, :meth:`swapped` around the computation that
    runs them (eager, warm-up and capture). ``what`` names them in logs and errors, ``setting``
    the option that asked for them. Layers whose dims are not multiples of 16 stay as they are
    with ``mode="cuda"`` (``skipped``)."""

    def __init__(self, layers, mode: str, *, what: str, setting: str, linears=DECODER_LINEARS):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"{what}: mode must be cuda or emulate, got {mode!r}")
        self.mode, sites, self.skipped = mode, [], []
        with torch.inference_mode(False), torch.no_grad():
            for i, layer in enumerate(layers):
                for block, names in linears:
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
                            raise RuntimeError(f"{setting}=true needs the bf16 model (policy.dtype bfloat16 or "
                                               f"auto on a GPU); the weights are {dtype}")
                        sites.append(_Site(parent, attr, Fp8Linear(n, k, w.device, dtype, mode == "emulate",
                                                                   bias is not None)))
        super().__init__(sites, what)
        log.info("%s: FP8 (e4m3, %s): %d linear layers%s", what, mode, len(self.sites),
                 f", kept in {len(self.skipped)} (dims not multiples of 16): {self.skipped[:4]}" if self.skipped else "")

    @property
    def requantized(self) -> int:
        """Layers re-quantized by sync (tests and logs read it)."""
        return self.refreshed
