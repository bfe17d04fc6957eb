"""The learner's figures: the summary its loops log (:meth:`LearnerStatus.summary`), that plus
the operator's view (:meth:`LearnerStatus.full`: :func:`learner.console.view_status`), and
``run_dir/status.json`` for people and tests (:meth:`LearnerStatus.write`). Also the warning
when optimizer steps are skipped for a non-finite loss or gradient (:mod:`learner.finite_guard`).

It reads the parts of a :class:`learner.app.Learner` and changes none of them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from learner.console import RateMeter, view_status
from learner.wire_guard import RateLimitedLog

log = logging.getLogger("tandem.learner")


class LearnerStatus:
    def __init__(self, learner: Any):
        self.learner = learner
        self._rates = {"status": RateMeter(), "view": RateMeter()}  # one per reader: status, view
        self._skip_warn = RateLimitedLog(log, burst=3, window_s=60.0)
        self._skipped_seen = 0

    def skipped_updates(self) -> dict[str, int]:
        """Optimizer steps skipped for a non-finite loss or gradient, by reason."""
        guard = getattr(self.learner.accelerator, "finite_guard", None)
        return dict(guard.skipped) if guard is not None else {}

    def note_skips(self) -> None:
        total = sum(self.skipped_updates().values())
        if total > self._skipped_seen:
            self._skip_warn.warning("%d optimizer step(s) skipped for a non-finite loss or gradient "
                                    "(%s in all); the weights stay finite", total - self._skipped_seen,
                                    self.skipped_updates())
            self._skipped_seen = total

    def summary(self) -> dict[str, float]:
        lrn = self.learner
        s = lrn.ingest.stats.summary()
        sizes = lrn.inference.batch_sizes[-200:]
        return {
            "updates": lrn.algo.updates, "version": lrn.weights.version,
            "env_steps": lrn.ingest.steps, "episodes": int(s.get("episodes", 0)),
            "return": s.get("return", float("nan")), "success": s.get("success", float("nan")),
            "actors": lrn.service.active_actors(), "buffer": len(lrn.data.sink),
            "infer_batch": float(sum(sizes) / len(sizes)) if sizes else 0.0,
            "served": lrn.inference.served, "infer_batches": lrn.inference.batches,
            "superseded_acts": lrn.inference.superseded,
            "rejected": lrn.service.counters["rejected"],
            "skipped_updates": sum(self.skipped_updates().values()),
            "weights_refused": lrn.weights.refused,
            "duplicates": lrn.service.counters["duplicates"],
            # the act latency over all actors and the whole run (learner/actor_stats.py)
            **lrn.actor_stats.act_latency(),
            # inference.serving_window: seconds training waited for served batches
            **({"window_waited_s": lrn.window.waited_s} if lrn.window is not None else {}),
        }

    def full(self, meter: str = "status") -> dict:
        """:meth:`summary` plus the operator's view: per-actor rows, rates, phase, GPU."""
        lrn = self.learner
        st: dict[str, Any] = self.summary()
        st.update(view_status(lrn, st, self._rates[meter]))
        if lrn.cfg.mode == "eval":
            st["eval_target"] = lrn.sweep.total if lrn.sweep is not None else int(lrn.cfg.eval.episodes)
        return st

    def write(self) -> None:
        """run_dir/status.json: counters for people and tests (atomic replace)."""
        lrn = self.learner
        service, ingest = lrn.service, lrn.ingest
        st = self.full()
        st.update(learner_id=service.learner_id, port=service.port,
                  pub_port=service.pub_port, received=dict(ingest.received),
                  stored=lrn.data.sink.total_added, rejections=dict(ingest.rejections),
                  dropped_episodes=dict(ingest.dropped_episodes), replay=lrn.data.status(),
                  staged_mb=round(ingest.episodes.staged_bytes / 2**20, 3),
                  rejected_by_code=dict(service.rejections), wire_gate={
                      "restarts": service.gate.restarts, "exits": list(service.gate.exits),
                      **service.gate.stats},
                  skipped_updates_by_reason=self.skipped_updates(),
                  act_latency_hist=lrn.actor_stats.act_histograms(),
                  checkpoints_refused=lrn.checkpoints.refused,
                  internal_errors=service.counters["internal_errors"],
                  rejection_logs_suppressed=service._warn.suppressed_total,  # noqa: SLF001
                  serving_window=lrn.window.stats() if lrn.window is not None else None,
                  serving_warmup=lrn.inference.warmup.stats(),
                  stopped=lrn.stopped, pid=os.getpid(),  # threads: for per-thread CPU (/proc)
                  threads={str(t.native_id): t.name for t in threading.enumerate() if t.native_id})
        tmp = lrn.run_dir / ".status.json.tmp"
        tmp.write_text(json.dumps(st, indent=1))
        tmp.replace(lrn.run_dir / "status.json")
