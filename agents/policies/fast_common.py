"""What the two fast serving paths (:mod:`agents.policies.pi0.fast`, :mod:`agents.policies.openvla_oft.fast`)
share: the ``fast_compile`` setting, the persistent inductor cache, portable compile artefacts,
marking dimensions dynamic for ``torch.compile``, the GPU kernel choices, and the warm-up a
server runs before it serves.

Portable artefacts (:func:`load_compile_artifacts`, :func:`save_compile_artifacts`): what a
warm-up compiled (FX graphs, Triton kernels, autotuning, AOT autograd) saved as one file per
device name and torch version, with ``torch.compiler.save_cache_artifacts``; loaded on another
machine before its warm-up, the compiles there are cache hits instead of inductor runs. The file
is executable code (torch unpickles it): trust it as you trust the checkpoint it ships with.

Dynamic dimensions: a compile is made with ``dynamic=None`` and only the dimensions marked here
symbolic (automatic dynamic is switched off during a capture), so one compile serves every batch
>= 2 (dynamo always specialises a size of 1: batch 1 gets a compile of its own) and every prompt
length; a new batch bucket or prompt length then costs a CUDA graph capture, not a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

import torch

log = logging.getLogger("tandem.policies.fast")

#: compile mode when ``fast_compile`` is on: "dynamic" (symbolic batch >= 2 and prompt length)
#: or "static" (one compile per shape)
COMPILE_MODE = "dynamic"
#: where compiled kernels persist when TORCHINDUCTOR_CACHE_DIR is unset ("" / None: torch's own
#: default, under /tmp)
CACHE_DIR = "~/.cache/tandem/inductor"


def resolve_compile(value: Any, cuda: bool) -> str | None:
    """``policy.fast_compile`` (auto | true | false) -> the compile mode or None: ``auto``
    compiles on a GPU only (on a CPU the fast path is not the default anyway)."""
    v = str(value).strip().lower()
    if v not in ("auto", "true", "false", "1", "0", "yes", "no", "on", "off", "static", "dynamic"):
        raise ValueError(f"policy.fast_compile must be auto, true or false, got {value!r}")
    if v in ("static", "dynamic"):
        return v
    on = cuda if v == "auto" else v in ("true", "1", "yes", "on")
    return COMPILE_MODE if on else None


def compile_mode(compile: bool | str | None, who: str) -> str | None:
    """A fast path's ``compile`` argument -> "dynamic", "static" or None (True: the default mode)."""
    mode = COMPILE_MODE if compile is True else (compile or None)
    if mode not in (None, "static", "dynamic"):
        raise ValueError(f"{who}: compile must be static, dynamic or off, got {compile!r}")
    return mode


def use_cache_dir(path: str | None = CACHE_DIR) -> str | None:
    """Point inductor's cache (FX graphs, Triton kernels, autotuning) at ``path`` unless
    TORCHINDUCTOR_CACHE_DIR is set to somewhere else than torch's default (importing lerobot
    already sets it to that default, under /tmp); returns the directory in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if path and os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        d = os.path.expanduser(path)
        os.makedirs(d, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def prepare_compile(cache_dir: str | None = CACHE_DIR) -> None:
    """Before the first compile: the persistent cache, and room for every (instance, bucket)
    guard set of the same code objects."""
    use_cache_dir(cache_dir)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # noqa: SLF001


def device_name(device: torch.device) -> str:
    """The GPU's name ("cpu" for any other device): what compiled artefacts are keyed by."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def compile_artifacts_file(folder: str | os.PathLike, device: torch.device | str | None = None) -> str:
    """The artefact file in ``folder`` for this device's name and this torch version (a
    file of another GPU model or torch is never loaded)."""
    name = device_name(torch.device(device)) if device is not None else "cpu"
    key = "".join(c if c.isalnum() or c in "-." else "_" for c in f"{name}-torch{torch.__version__}")
    return os.path.join(os.path.expanduser(str(folder)), f"compile-{key}.bin")


def load_compile_artifacts(folder: str | os.PathLike, device: torch.device | str | None = None) -> bool:
    """Load ``folder``'s artefacts for this device and torch into inductor's caches, before a
    warm-up; False when there is no such file. A file torch cannot read is reported (named)
    and skipped: the warm-up then compiles as usual."""
    path = compile_artifacts_file(folder, device)
    if not os.path.isfile(path):
        return False
    use_cache_dir()
    try:
        with open(path, "rb") as f:
            info = torch.compiler.load_cache_artifacts(f.read())
    except Exception as exc:  # noqa: BLE001 - a stale or damaged file must not stop serving
        log.warning("compile artefacts %s not loaded (%s: %s); compiling instead", path, type(exc).__name__, exc)
        return False
    if info is None:  # torch reports what it could not read (a damaged file) and returns None
        log.warning("compile artefacts %s not loaded (torch could not read them); compiling instead", path)
        return False
    n = sum(len(v) for v in getattr(info, "artifacts", {}).values())
    log.info("compile artefacts loaded from %s (%d entries)", path, n)
    return True


def save_compile_artifacts(folder: str | os.PathLike, device: torch.device | str | None = None) -> str | None:
    """Write what this process compiled (loaded artefacts included) to ``folder``'s file for
    this device and torch (written aside, then renamed); None when nothing was compiled."""
    art = torch.compiler.save_cache_artifacts()
    if art is None or not art[0]:
        return None
    path = compile_artifacts_file(folder, device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(art[0])
    os.replace(tmp, path)
    log.info("compile artefacts saved to %s (%.1f MB)", path, len(art[0]) / 1e6)
    return path


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (a new bucket that needs none was a capture)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_dynamic(dims: tuple[int, ...], *tensors) -> None:
    """Dimensions ``dims`` of each tensor (or list of tensors) symbolic for the next compile; a
    batch dimension (0) only where it is > 1 (dynamo specialises 1). All tensors that meet in a
    cat or a broadcast must be marked: one left static would specialise the others."""
    for t in tensors:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            if not isinstance(x, torch.Tensor):
                continue
            for d in dims:
                if d < x.dim() and (d != 0 or x.shape[0] > 1) and x.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(x, d)  # noqa: SLF001


def static_shapes_only():
    """Context of a capture: no automatic dynamic shapes (only what :func:`mark_dynamic` marked)."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)  # noqa: SLF001


#: SDPA backends in priority order (the first that supports a call runs it)
SDPA_ORDER = ("efficient", "flash", "cudnn", "math")


@contextlib.contextmanager
def gpu_kernels(cuda: bool, order: tuple[str, ...] = SDPA_ORDER):
    """On a GPU: TF32 matmuls and convolutions (lerobot keeps SigLIP and the projector in
    float32, a large share of a PI0 call in plain fp32 GEMMs; TF32 keeps more mantissa than the
    bf16 the rest of the model runs in), and SDPA's memory-efficient kernel first (faster than
    cuDNN's on a denoising step's few queries), or ``order``. Restored after."""
    if not cuda:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        names = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
        with sdpa_kernel([names[n] for n in order], set_priority=True):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def prompt_width_tasks(columns: Callable[[str], int], max_columns: int, base: str = "warm up",
                       word: str = " up", tries: int = 256) -> list[str]:
    """The shortest task of each distinct prompt width up to ``max_columns``, ``base`` first
    (whatever its width): ``columns(task)`` is the token columns a fast path pads a lone prompt of
    that task to (its graphs are keyed by them). The task grows a ``word`` at a time. A warm-up act
    of each task captures the graphs that every prompt up to that width replays, so a longer
    instruction (LIBERO's) is not captured on its first act while serving."""
    out, seen, task = [], set(), base
    for _ in range(tries):
        c = columns(task)
        if c > max_columns and out:
            break
        if c not in seen:
            seen.add(c)
            out.append(task)
        if c >= max_columns:
            break
        task += word
    return out


def warm_up(policy, get_fast, batch_sizes, *, max_batch: int | None = None,
            acts: tuple[bool, ...] = (True,), tasks: Callable[[], list[str]] | None = None) -> dict[int, float]:
    """Compile and capture the fast path's graphs for ``batch_sizes`` (each padded to its bucket;
    sizes above ``max_batch`` are skipped) before a server takes requests: a ``policy.act`` of a
    blank observation per bucket, ``deterministic`` flag in ``acts`` (a policy whose two kinds
    of act run different graphs lists both) and task of ``tasks()`` (default: the policy's
    ``default_task`` or "warm up"; :func:`prompt_width_tasks` gives one per prompt width), timed
    and logged. ``get_fast()`` (called
    without gradients) is the policy's fast path or None; it has ``graphs``, ``bucket(b)``,
    ``captures``, ``compiles`` and ``compile``. Returns {bucket: seconds}; {} where the policy
    serves without graphs (a CPU, fast serving off or eager, training mode)."""
    from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK

    with torch.no_grad():
        fast = get_fast()
        if fast is None or not fast.graphs or policy.device.type != "cuda":
            log.info("%s: no warm-up (the fast path captures no graphs here)", policy.who)
            return {}
        sizes = sorted({fast.bucket(int(b)) for b in batch_sizes
                        if int(b) >= 1 and (max_batch is None or int(b) <= max_batch)} - {None})
        spec, dev, out = policy.spec, policy.device, {}
        texts = tasks() if tasks is not None else [policy.cfg.default_task or "warm up"]
        for b in sizes:
            obs = {OBS_STATE: torch.zeros(b, spec.state_dim, device=dev)}
            for cam, (h, w, c) in spec.cameras.items():
                obs[OBS_IMAGE_PREFIX + cam] = torch.zeros(b, h, w, c, dtype=torch.uint8, device=dev)
            t0, captures, compiles = time.perf_counter(), fast.captures, fast.compiles
            for text in texts:
                for deterministic in acts:
                    policy.act({**obs, TASK: [text] * b}, deterministic=deterministic)
            torch.cuda.synchronize(dev)
            out[b] = time.perf_counter() - t0
            log.info("%s: warm-up batch %d ready in %.1f s (%d prompt width(s), %d capture(s), %d compiled "
                     "graph(s), compile=%s)", policy.who, b, out[b], len(texts), fast.captures - captures,
                     fast.compiles - compiles, fast.compile)
    return out


# -- a CUDA graph's static inputs (agents/policies/pi0/fast.py) -------------------------------------

def input_signature(inputs: dict) -> tuple:
    """Shapes and dtypes past the batch dimension, by input name (a graph serves one signature)."""
    def sig(t):
        return None if t is None else (tuple(t.shape[1:]), t.dtype)

    return tuple((k, tuple(sig(t) for t in v) if isinstance(v, list) else sig(v)) for k, v in sorted(inputs.items()))


def padded_inputs(inputs: dict, n: int) -> dict:
    """Static buffers of batch ``n``: the inputs, rows repeated to fill (cloned, owned here)."""
    def grow(t):
        if t is None:
            return None
        idx = torch.arange(n, device=t.device) % t.shape[0]
        return t[idx].clone()

    return {k: ([grow(t) for t in v] if isinstance(v, list) else grow(v)) for k, v in inputs.items()}


def copy_inputs(static: dict, inputs: dict, b: int) -> None:
    """The first ``b`` rows of each static buffer from ``inputs`` (no host sync)."""
    for k, v in inputs.items():
        if v is None:
            continue
        if isinstance(v, list):
            for dst, src in zip(static[k], v, strict=True):
                dst[:b].copy_(src, non_blocking=True)
        else:
            static[k][:b].copy_(v, non_blocking=True)
