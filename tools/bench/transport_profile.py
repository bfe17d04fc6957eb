"""``--profile`` passes of the transport bench (Tandem only): per-stage timers around the
learner's per-message work, then cProfile on both sides."""

from __future__ import annotations

import cProfile
from typing import Any, Callable

import numpy as np

from tools.bench.common import perf
from tools.bench.procstat import stats_text
from tools.bench.transport_client import WorkerHandle
from tools.bench.transport_ingest import ingest_round_tandem
from tools.bench.transport_server import TandemStack


class StageTimers:
    """Monkeypatched timing wrappers around the learner's per-message work (this process)."""

    def __init__(self):
        self.acc: dict[str, list[float]] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:  # the learner code changed: time what still exists
            return
        acc = self.acc.setdefault(name, [0, 0.0])

        def timed(*a, **kw):
            t0 = perf()
            try:
                return orig(*a, **kw)
            finally:
                acc[0] += 1
                acc[1] += perf() - t0

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, orig))

    def install(self) -> None:
        import data.replay
        import learner.inference
        import learner.ingest
        import learner.service

        s = learner.service
        self.wrap(s.LearnerService, "_handle", "service._handle (all per-message work)")
        self.wrap(s, "decode", "  codec.decode")
        self.wrap(s.LearnerService, "_on_transitions", "  _on_transitions")
        self.wrap(s.TransitionBatch, "validate", "    TransitionBatch.validate")
        self.wrap(learner.ingest.Ingest, "add", "    Ingest.add")
        self.wrap(data.replay.ReplayBuffer, "add", "      ReplayBuffer.add")
        self.wrap(learner.ingest.Ingest, "_track", "      Ingest._track")
        self.wrap(s.LearnerService, "_send", "    service._send (ack)")
        self.wrap(s, "check_obs", "  check_obs (act)")
        self.wrap(learner.inference.InferenceServer, "_serve", "inference._serve (act)")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def report(self, per: int) -> dict[str, dict[str, float]]:
        return {k: {"calls": c, "total_ms": t * 1e3, "us_per_unit": t * 1e6 / max(per, 1)}
                for k, (c, t) in self.acc.items() if c}


def bench_profile(cfg: dict, worker: WorkerHandle, act_stack: TandemStack, ing_stack: TandemStack) -> dict:
    n_b, n_a = cfg["ingest_batches"], cfg["act_iters"]
    out: dict[str, Any] = {}
    # Pass 1: stage timers (cheap wrappers; per batch / per act figures).
    timers = StageTimers()
    timers.install()
    try:
        fill = worker.call("fill", n=n_b)
        r = ingest_round_tandem(worker, ing_stack, fill)
        out["ingest_timed_round_mb_s"] = r["mb_s"]
        out["ingest_wall_us_per_batch"] = r["seconds"] * 1e6 / n_b
        out["ingest_stages_per_batch"] = timers.report(n_b)
        timers.acc.clear()
        timers.uninstall()
        timers.install()
        res = worker.call("act", kind="tandem", n=n_a)
        out["act_wall_us_per_call"] = float(np.median(res["t1"] - res["t0"]) * 1e6)
        out["act_stages_per_call"] = timers.report(n_a)
    finally:
        timers.uninstall()
    # Pass 2: cProfile. In Python 3.12 one enabled profiler sees every thread of the process.
    top = cfg["profile_top"]
    prof = cProfile.Profile()
    fill = worker.call("fill", n=n_b)
    prof.enable()
    r = ingest_round_tandem(worker, ing_stack, fill, profile=True)
    prof.disable()
    out["ingest_cprofile_server"] = stats_text(prof, top)
    out["ingest_cprofile_client"] = r.get("profile")
    prof = cProfile.Profile()
    prof.enable()
    res = worker.call("act", kind="tandem", n=n_a, profile=True)
    prof.disable()
    out["act_cprofile_server"] = stats_text(prof, top)
    out["act_cprofile_client"] = res.get("profile")
    return out
