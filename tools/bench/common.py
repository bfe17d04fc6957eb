"""Fixtures shared by the benchmarks: timing statistics, loopback ports, bench specs and
observations, a loopback learner, logging and JSON output."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from data.core.spec import EnvSpec

ROOT = Path(__file__).resolve().parents[2]  # the repository root
HOST = "127.0.0.1"

perf = time.perf_counter


# ---- timing statistics -----------------------------------------------------------------------

def percentile(x, q: float) -> float:
    return float(np.percentile(x, q))


def median(xs: list[float]) -> float:
    """Median of ``xs``; NaN when there is none."""
    return float(statistics.median(xs)) if xs else float("nan")


#: the widest 95% interval of a median (relative half-width) that counts as stable
CI_REL_TARGET = 0.05


def median_ci(xs, conf: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free ``conf`` interval of the median from order statistics: the sorted
    samples ``[x_(l), x_(n+1-l)]`` with the largest ``l`` such that ``P(Binom(n, 1/2) < l)
    <= (1-conf)/2`` (exact binomial up to 2000 samples, normal approximation above). None
    when there are too few samples (n < 6 at 95%)."""
    x = np.sort(np.asarray(xs, dtype=float))
    n = len(x)
    alpha = (1.0 - conf) / 2
    if n > 2000:
        z = statistics.NormalDist().inv_cdf(1 - alpha)
        lo = int(np.floor(n / 2 - z * np.sqrt(n) / 2))
    else:
        cdf, lo = 0.0, 0
        for k in range(n + 1):  # cdf = P(B <= k - 1) before adding P(B = k)
            p = math.comb(n, k) / (1 << n)
            if cdf + p > alpha:
                break
            cdf += p
            lo = k + 1
        lo -= 1  # 0-based index of x_(l) with l = lo + 1
    if lo < 0:
        return None
    return float(x[lo]), float(x[n - 1 - lo])


def ci_fields(xs, target: float = CI_REL_TARGET) -> dict:
    """``ci95`` [lo, hi] of the median, ``ci_rel`` (the larger side over the median) and
    ``stable`` (``ci_rel <= target``); nulls when there are too few samples."""
    ci = median_ci(xs)
    if ci is None or not len(xs):
        return {"ci95": None, "ci_rel": None, "stable": False}
    med = float(np.median(xs))
    rel = max(med - ci[0], ci[1] - med) / abs(med) if med else float("inf")
    return {"ci95": [ci[0], ci[1]], "ci_rel": rel, "stable": rel <= target}


def p50_p99(xs) -> dict:
    """``{"p50", "p99", "n", "ci95", "ci_rel", "stable"}`` of a list of samples. The sample
    count travels with the figures: a p99 over fewer than ~100 samples is close to the
    maximum; ``ci95`` is the 95% interval of the p50 (:func:`median_ci`)."""
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs), **ci_fields(xs)}


def bootstrap_ratio_ci(num, den, *, reps: int = 2000, seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap interval of ``median(num) / median(den)`` (each resampled
    on its own); None with fewer than 3 samples on a side."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    if len(a) < 3 or len(b) < 3:
        return None
    rng = np.random.default_rng(seed)
    ra = np.median(a[rng.integers(0, len(a), (reps, len(a)))], axis=1)
    rb = np.median(b[rng.integers(0, len(b), (reps, len(b)))], axis=1)
    lo, hi = np.percentile(ra / rb, [2.5, 97.5])
    return [float(lo), float(hi)]


def ci_warning(name: str, stats: dict, target: float = CI_REL_TARGET) -> str | None:
    """A one-line warning when ``stats`` (from :func:`p50_p99`) has a wide or no interval."""
    if stats.get("ci_rel") is None:
        return f"{name}: too few samples ({stats.get('n')}) for a 95% interval of the median"
    if stats["ci_rel"] > target:
        lo, hi = stats["ci95"]
        return (f"{name}: p50 {stats['p50']:.4g}, 95% interval [{lo:.4g}, {hi:.4g}] is "
                f"+/-{stats['ci_rel']:.1%}, wider than +/-{target:.0%}: the figure is noisy")
    return None


def matmul_peak(device: str, n: int, reps: int = 10) -> dict:
    """TFLOP/s of ``torch.mm`` on n x n matrices (bf16 on a GPU, float32 on a CPU), median."""
    import torch

    cuda = device.startswith("cuda")
    dt = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        torch.mm(a, b)
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        ts.append(time.perf_counter() - t0)
    med = median(ts)
    return {"n": n, "dtype": str(dt).replace("torch.", ""), "median_ms": med * 1e3, "tflops": 2 * n ** 3 / med / 1e12}


def timed_ms(fn: Callable[[], Any], iters: int, warmup: int,
             sync: Callable[[], Any] = lambda: None, *, max_iters: int | None = None,
             max_s: float = 120.0, target: float = CI_REL_TARGET) -> list[float]:
    """Milliseconds per call of ``fn`` (``sync()`` after each: e.g. torch.cuda.synchronize),
    after ``warmup`` untimed calls: ``iters`` calls, then more (up to ``max_iters`` calls or
    ``max_s`` seconds) until the 95% interval of the median is within ``+/-target``."""
    for _ in range(warmup):
        fn()
    sync()
    out: list[float] = []
    cap = max(iters, max_iters or iters)
    t_start = perf()
    while len(out) < cap:
        t0 = perf()
        fn()
        sync()
        out.append((perf() - t0) * 1000.0)
        n = len(out)
        if n >= iters and (n == iters or n % 20 == 0):
            if ci_fields(out, target)["stable"] or perf() - t_start > max_s:
                break
    return out


def rate(fn: Callable[[], Any], n: int, warmup: int = 2) -> float:
    """Calls per second of ``fn`` over ``n`` back-to-back calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    t = perf()
    for _ in range(n):
        fn()
    return n / (perf() - t)


# ---- the GPU's state ---------------------------------------------------------------------------

_SMI_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
               "temperature.gpu", "utilization.gpu")


def gpu_state(device_index: int | None = None) -> dict | None:
    """Clocks, power and other processes of the GPU the bench runs on, from ``nvidia-smi``:
    ``sm_clock_mhz``, ``mem_clock_mhz`` (and their maxima), ``power_w``, ``temperature_c``,
    ``utilization_pct`` and ``other_processes`` (compute processes on the GPU that are not
    this one: their pid and used MiB; a shared GPU makes timings noisy). None without a
    CUDA device or ``nvidia-smi``."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        idx = torch.cuda.current_device() if device_index is None else device_index
    except Exception:
        return None
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # torch's index counts the visible devices only
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        idx = ids[idx] if idx < len(ids) else idx

    def smi(*args: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--id={idx}", *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return [[c.strip() for c in ln.split(",")] for ln in out.stdout.splitlines() if ln.strip()]

    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None
    try:
        row = smi("--query-gpu=" + ",".join(_SMI_FIELDS))[0]
        apps = smi("--query-compute-apps=pid,used_memory")
    except Exception as exc:  # noqa: BLE001 - a broken nvidia-smi must not stop the bench
        return {"error": f"nvidia-smi failed: {type(exc).__name__}: {exc}"}
    v = dict(zip(_SMI_FIELDS, (num(x) for x in row)))
    own = {os.getpid(), *_child_pids()}
    others = [{"pid": int(a[0]), "used_mib": num(a[1])} for a in apps
              if a and a[0].isdigit() and int(a[0]) not in own]
    return {"sm_clock_mhz": v["clocks.sm"], "mem_clock_mhz": v["clocks.mem"],
            "max_sm_clock_mhz": v["clocks.max.sm"], "max_mem_clock_mhz": v["clocks.max.mem"],
            "power_w": v["power.draw"], "temperature_c": v["temperature.gpu"],
            "utilization_pct": v["utilization.gpu"], "other_processes": others,
            "shared": bool(others)}


def _child_pids() -> list[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


# ---- ports -----------------------------------------------------------------------------------

def bind_loopback(sock) -> int:
    """Bind a ZMQ socket to a loopback port picked by the OS; returns the port."""
    import zmq

    sock.bind(f"tcp://{HOST}:0")
    return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


# ---- specs, observations, records ------------------------------------------------------------

def bench_spec(state_dim: int, action_dim: int, cameras: Iterable[str], image: int | tuple[int, int],
               has_task: bool = False) -> EnvSpec:
    """An EnvSpec with the named cameras, all ``image`` (side, or (H, W)) x 3 uint8."""
    h, w = (image, image) if isinstance(image, int) else image
    return EnvSpec(state_dim=state_dim, action_dim=action_dim, cameras={c: (h, w, 3) for c in cameras},
                   has_task=has_task)


def random_images(rng: np.random.Generator, cameras: dict, n: int = 1) -> dict[str, np.ndarray]:
    """``observation.images.<cam>`` -> uniform random uint8 [n, H, W, 3] per camera (H, W, 3)."""
    from data.core.schema import OBS_IMAGE_PREFIX

    return {OBS_IMAGE_PREFIX + c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
            for c, (h, w, _) in cameras.items()}


def random_obs(state_dim: int, cameras: dict, n: int = 1, seed: int = 0, state: str = "uniform") -> dict:
    """A batch of ``n`` observations: float32 state (``"uniform"`` in [-1, 1) or ``"normal"``)
    then random uint8 images, drawn in that order from ``default_rng(seed)``."""
    from data.core.schema import OBS_STATE

    rng = np.random.default_rng(seed)
    if state == "normal":
        s = rng.standard_normal((n, state_dim), dtype=np.float32)
    else:
        s = rng.uniform(-1, 1, (n, state_dim)).astype(np.float32)
    return {OBS_STATE: s, **random_images(rng, cameras, n)}


def episode_flags(n: int, episode: int) -> dict[str, np.ndarray]:
    """The bookkeeping columns of one episode of ``n`` records: n-1 steps, the last one
    truncated, then the final observation's ``is_last`` record."""
    truncated = np.zeros(n, bool)
    truncated[n - 2] = True
    is_last = np.zeros(n, bool)
    is_last[n - 1] = True
    return {
        "terminated": np.zeros(n, bool),
        "truncated": truncated,
        "intervened": np.zeros(n, bool),
        "is_last": is_last,
        "success": np.zeros(n, bool),
        "policy_version": np.zeros(n, np.int64),
        "episode": np.full(n, episode, np.int64),
        "step": np.arange(n, dtype=np.int64),
    }


# ---- a loopback learner ----------------------------------------------------------------------

class LoopbackLearner:
    """LearnerService + InferenceServer + Ingest + ReplayBuffer on loopback ports picked by the
    OS, wired as learner/app.py does. ``start()`` starts both threads; subclasses may override
    ``_submit`` / ``_reply`` (the service -> inference and inference -> service hand-offs)."""

    def __init__(self, policy, spec: EnvSpec, config_hash: str, *, buffer_capacity: int, device,
                 get_version: Callable[[], int] = lambda: 0, get_weights: Callable[[], Any] = lambda: None,
                 service_kw: dict | None = None, inference_kw: dict | None = None):
        import zmq

        from data.replay import ReplayBuffer
        from learner.inference import InferenceServer
        from learner.ingest import Ingest
        from learner.service import LearnerService

        self.ctx = zmq.Context()
        self.policy = policy
        self.buffer = ReplayBuffer(buffer_capacity, spec)
        self.ingest = Ingest(self.buffer, store_transitions=True)
        self.service = LearnerService(
            ctx=self.ctx, spec=spec, config_hash=config_hash, ingest=self.ingest,
            submit_act=self._submit, get_version=get_version, get_weights=get_weights,
            host=HOST, port=0, pub_port=0, **(service_kw or {}),
        )
        self.inference = InferenceServer(
            policy, reply=self._reply, active_actors=self.service.active_actors, device=device,
            act_channel=self.service.act_channel, **(inference_kw or {}),
        )

    @property
    def port(self) -> int:
        return self.service.port

    def _submit(self, req) -> None:
        self.inference.submit(req)

    def _reply(self, identity: bytes, frames: list) -> None:
        self.service.reply(identity, frames)

    def start(self) -> None:
        self.service.start()
        self.inference.start()

    def close(self) -> None:
        self.inference.stop()
        self.service.stop()
        self.inference.join(timeout=5)
        self.service.join(timeout=5)
        self.ctx.destroy(linger=0)


# ---- output ----------------------------------------------------------------------------------

def quiet_logging() -> None:
    """Warnings and errors only, on stderr (stdout carries the figures)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def emit_json(obj: Any, dest: str = "-") -> None:
    """``dest`` "-": exactly one JSON line on stdout; else write it, indented, to that path."""
    if dest == "-":
        sys.stdout.write(json.dumps(obj) + "\n")
    else:
        Path(dest).write_text(json.dumps(obj, indent=1))
