"""Pieces shared by the large VLA policies (:mod:`agents.policies.pi0.policy`,
:mod:`agents.policies.openvla_oft.policy`): device/dtype choice, observation checks, local
tokenizers, LoRA through peft (injected in place, no wrapper model), adapter-only state
dicts, adapters folded into the weights for serving, strict checkpoint loading.

Observation layout (see :mod:`data.core.schema`): ``"observation.state"`` float32 [B, S],
``"observation.images.<cam>"`` uint8 [B, H, W, 3] for each camera of the env spec,
``"task"`` list[str] of length B.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.policies")


class CheckpointMismatch(ValueError):
    """A checkpoint's files or tensors do not match the architecture its config describes."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, bfloat16, float32 or float16, got {name!r}") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters in ``dtype`` (floating point) inside the block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# -- observations -------------------------------------------------------------------------
def check_obs(obs: Mapping[str, Any], spec: EnvSpec, who: str) -> int:
    """Check state and cameras against the env spec; returns the batch size B.

    Raises ValueError naming the camera/key and the expected vs actual shape.
    """
    if OBS_STATE not in obs:
        raise ValueError(f"{who}: observation has no {OBS_STATE!r}")
    state = obs[OBS_STATE]
    if state.ndim != 2 or state.shape[1] != spec.state_dim:
        raise ValueError(f"{who}: {OBS_STATE} must be [B, {spec.state_dim}], got {list(state.shape)}")
    b = int(state.shape[0])
    want = spec.image_keys
    got = sorted(k for k in obs if k.startswith(OBS_IMAGE_PREFIX))
    if got != want:
        raise ValueError(
            f"{who}: expected {len(want)} camera image(s) {want}, got {len(got)} {got}"
        )
    for k in want:
        h, w, c = spec.cameras[k[len(OBS_IMAGE_PREFIX):]]
        img = obs[k]
        if tuple(img.shape) != (b, h, w, c) or img.dtype != torch.uint8:
            raise ValueError(
                f"{who}: camera {k!r} must be uint8 [B={b}, {h}, {w}, {c}], got "
                f"{str(img.dtype).replace('torch.', '')} {list(img.shape)}"
            )
    return b


def get_tasks(obs: Mapping[str, Any], b: int, default: str | None, who: str) -> list[str]:
    """The B instructions; an empty or absent one takes ``default`` or is an error."""
    tasks = obs.get(TASK)
    if tasks is None:
        tasks = [""] * b
    if isinstance(tasks, str):
        tasks = [tasks] * b
    tasks = list(tasks)
    if len(tasks) != b:
        raise ValueError(f"{who}: obs['task'] must hold {b} instruction(s), got {len(tasks)}")
    out = []
    for i, t in enumerate(tasks):
        if not isinstance(t, str) or not t.strip():
            if default is None:
                raise ValueError(
                    f"{who}: missing instruction for batch row {i} (obs['task'] must be a non-empty "
                    f"string per row, or set the policy's default_task)"
                )
            t = default
        out.append(t)
    return out


# -- tokenizers ---------------------------------------------------------------------------
def load_local_tokenizer(path: str | Path, who: str, *, builtin: tuple[str, int] | None = None):
    """A tokenizer from a local folder only (never the hub). ``path="builtin"`` with
    ``builtin=(kind, vocab_size)``: :func:`agents.policies.tokenizers.builtin_tokenizer`."""
    from agents.policies.tokenizers import BUILTIN, builtin_tokenizer

    if str(path) == BUILTIN:
        if builtin is None:
            raise ValueError(f"{who}: this policy has no builtin tokenizer; set a local tokenizer folder")
        path = builtin_tokenizer(*builtin)
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{who}: tokenizer folder {str(p)!r} does not exist (tokenizers are "
                                f"loaded from local folders only; tools/make_tiny_checkpoints.py builds one)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (p / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


# -- LoRA / trainable tensors ---------------------------------------------------------------
def lora_regex(scopes: Mapping[str, str], chosen: Iterable[str], modules: Iterable[str]) -> str:
    """peft target regex: Linear layers named ``modules`` inside the chosen module ``scopes``."""
    chosen = list(chosen)
    unknown = sorted(set(chosen) - set(scopes))
    if unknown:
        raise ValueError(f"unknown LoRA scope(s) {unknown}; choose from {sorted(scopes)}")
    mods = "|".join(re.escape(m) for m in modules)
    where = "|".join(scopes[s] for s in chosen)
    return rf"^({where})\..*\.({mods})$"


def add_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, target_regex: str,
             dtype: torch.dtype = torch.float32) -> int:
    """Inject LoRA adapters in place (no wrapper module); returns the number of adapted layers."""
    from peft import LoraConfig, inject_adapter_in_model

    n = sum(1 for name, m in model.named_modules() if isinstance(m, nn.Linear) and re.match(target_regex, name))
    if n == 0:
        raise ValueError(f"LoRA target regex {target_regex!r} matches no Linear layer")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_regex,
                     bias="none")
    inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.data = p.data.to(dtype)  # adapters train in float32 over a bf16 base
    return n


class LoRAServing:
    """Adapters folded into the base weights for serving: W = W0 + scale * B @ A (computed in
    float32 from the pristine W0, kept on the device), and every peft wrapper swapped for its
    plain base Linear, so that an inference forward runs no adapter code at all (the large
    models are kernel-launch bound at small batches; the adapter path doubles the launches).
    :meth:`unfold` puts W0 and the wrappers back (training, loading new adapters)."""

    def __init__(self, root: nn.Module):
        self.sites = []  # (parent module, attribute, peft LoRA layer)
        for parent in root.modules():
            for attr, child in list(parent.named_children()):
                if hasattr(child, "lora_A") and hasattr(child, "base_layer"):
                    self.sites.append((parent, attr, child))
        self.w0: list[torch.Tensor] | None = None
        self.folded = False
        #: while True, :meth:`fold` does nothing (the adapters are switched off: a reference pass)
        self.pinned = False

    def fold(self) -> None:
        if self.folded or self.pinned or not self.sites:
            return
        with torch.inference_mode(False), torch.no_grad():  # W0 must stay a normal tensor
            self._fold()

    def _fold(self) -> None:
        if self.w0 is None:
            self.w0 = [m.base_layer.weight.detach().clone() for _, _, m in self.sites]
        for (parent, attr, m), w0 in zip(self.sites, self.w0):
            delta = sum((m.lora_B[a].weight.float() @ m.lora_A[a].weight.float()) * m.scaling[a]
                        for a in m.active_adapters)
            w = m.base_layer.weight
            w.copy_((w0.to(w.device).float() + delta).to(w.dtype))
            setattr(parent, attr, m.base_layer)
        self.folded = True

    def unfold(self) -> None:
        if not self.folded:
            return
        with torch.inference_mode(False), torch.no_grad():
            for (parent, attr, m), w0 in zip(self.sites, self.w0):
                m.base_layer.weight.copy_(w0)
                setattr(parent, attr, m)
        self.folded = False


def effective_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """(weight [N, K] float32, bias or None, the parameters it was computed from) of a plain
    Linear or a peft LoRA Linear (base + scale * B @ A over the active adapters, as
    :class:`LoRAServing` folds it; base only where adapters are disabled or merged already)."""
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        base = module.base_layer
        if any(getattr(module, "use_dora", {}).get(a, False) for a in module.active_adapters):
            raise TypeError("DoRA adapters are not folded into a weight here")
        w, srcs = base.weight.float(), [base.weight]
        if not (getattr(module, "disable_adapters", False) or getattr(module, "merged", False)):
            for a in module.active_adapters:
                if a in module.lora_A:
                    wa, wb = module.lora_A[a].weight, module.lora_B[a].weight
                    w = w + (wb.float() @ wa.float()) * module.scaling[a]
                    srcs += [wa, wb]
        bias = base.bias
    elif isinstance(module, nn.Linear):
        w, srcs, bias = module.weight.float(), [module.weight], module.bias
    else:
        raise TypeError(f"expected a Linear or a peft LoRA Linear, got {type(module).__name__}")
    if bias is not None:
        srcs.append(bias)
    return w, bias, srcs


def set_trainable(model: nn.Module, head_prefixes: Iterable[str]) -> None:
    """Freeze everything except LoRA adapters and the modules named by ``head_prefixes``."""
    heads = tuple(h.rstrip(".") + "." for h in head_prefixes)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith(heads))


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the parameters that train (adapters + heads), by name."""
    return {k: p.detach().to("cpu", copy=True) for k, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: nn.Module, state: Mapping[str, torch.Tensor], who: str) -> None:
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"{who}: trainable state does not match this policy: missing {missing[:4]} "
                         f"({len(missing)}), unexpected {unexpected[:4]} ({len(unexpected)}); was it made "
                         f"by a policy with the same LoRA rank/targets and heads?")
    for k, p in params.items():
        t = state[k]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{who}: trainable tensor {k!r} has shape {list(t.shape)}, policy has {list(p.shape)}")
        p.copy_(t.to(device=p.device, dtype=p.dtype))


def n_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- checkpoints ----------------------------------------------------------------------------
def check_state_layout(expected: Mapping[str, torch.Tensor], got: Mapping[str, Any], where: str,
                       what: str, optional: Iterable[str] = ()) -> None:
    """Raise :class:`CheckpointMismatch` listing missing/unexpected keys and shape mismatches.

    ``got`` maps names to tensors or to shapes (tuples); names in ``optional`` may be absent.
    """
    optional = set(optional)
    missing = sorted(set(expected) - set(got) - optional)
    unexpected = sorted(set(got) - set(expected))
    shapes = []
    for k in sorted(set(expected) & set(got)):
        g = got[k]
        gs = tuple(g.shape) if hasattr(g, "shape") else tuple(g)
        if gs != tuple(expected[k].shape):
            shapes.append(f"{k}: checkpoint {list(gs)} vs model {list(expected[k].shape)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s) (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s) (e.g. {unexpected[:3]})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es) (e.g. {shapes[:3]})")
        raise CheckpointMismatch(f"checkpoint {where} does not match {what}: " + "; ".join(parts))


class ReferenceSnapshot:
    """A LoRA policy's KL reference without a second model: the values its trained parameters
    (adapters and fully trained heads; not those under ``skip``, e.g. a value head) had at one
    point, in host memory, swapped in for a reference pass. Taken at construction (LoRA B = 0:
    the base model with the initial heads) and again by :meth:`take` once a start is loaded
    (``policy.init_trainable``, an SFT run), so that RL after SFT is pulled toward the SFT
    policy, not the model before it."""

    def __init__(self, module: nn.Module, lora: LoRAServing, skip: Iterable[str] = ()):
        self.module, self.lora, self.skip = module, lora, tuple(skip)
        self.take()

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and not n.startswith(self.skip)]

    def take(self) -> None:
        """The parameters' values now become the reference's."""
        self.lora.unfold()  # a folded adapter lives in the base weights
        self.values = {n: p.detach().to("cpu", copy=True) for n, p in self._params()}

    @contextlib.contextmanager
    def swapped(self):
        """Inside: the module computes with the snapshot's values (unfolded; folding pinned
        off); on exit the current values are back."""
        self.lora.unfold()
        params = self._params()
        saved = [p.detach().clone() for _, p in params]
        with torch.no_grad():
            for n, p in params:
                p.copy_(self.values[n])
        self.lora.pinned = True
        try:
            yield
        finally:
            self.lora.pinned = False
            with torch.no_grad():
                for (_, p), v in zip(params, saved):
                    p.copy_(v)
