"""Fixtures shared by the benchmarks: timing statistics, loopback ports, bench specs and
observations, a loopback learner, logging and JSON output."""

from __future__ import annotations

import json
import logging
import statistics
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


def p50_p99(xs) -> dict:
    """``{"p50", "p99", "n"}`` of a list of samples. The sample count travels with the figures:
    a p99 over fewer than ~100 samples is close to the maximum."""
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}


def timed_ms(fn: Callable[[], Any], iters: int, warmup: int,
             sync: Callable[[], Any] = lambda: None) -> list[float]:
    """Milliseconds per call of ``fn`` (``sync()`` after each: e.g. torch.cuda.synchronize),
    after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = perf()
        fn()
        sync()
        out.append((perf() - t0) * 1000.0)
    return out


def rate(fn: Callable[[], Any], n: int, warmup: int = 2) -> float:
    """Calls per second of ``fn`` over ``n`` back-to-back calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    t = perf()
    for _ in range(n):
        fn()
    return n / (perf() - t)


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
            **(inference_kw or {}),
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
