"""Rejection sampling's cadence (:class:`RSLearner`, Hi-ORS):

1. ``pretrain``: ``pretrain_steps`` BC steps on the demos alone, then a new version.
2. ``eval`` (of the starting version, ``eval_initial``): its success becomes the first best.
3. ``collect``: actors run the current version freely; ``env_steps_per_cycle`` new env steps
   (evaluation episodes excluded; steps that arrive while a cycle trains or evaluates count
   toward the next one) start a cycle.
4. ``train``: ``sft_steps_per_cycle`` BC steps on the success store with demos mixed in,
   then a new version is published.
5. ``eval``: deterministic learner jobs (every task of ``eval_task_ids`` x every init state)
   run the new version; an episode counts when every step came from that version (a stale
   one is re-queued) and no person touched it. Success >= best - ``eval_tolerance``: kept
   (and the new best when >= best); otherwise the best weights are restored and published
   as a new version (a roll-back). Back to 3.

On N ranks (:mod:`learner.distributed`) this cadence runs on rank 0 alone: it samples every
global batch and hands it, with the step's learning rate (:func:`agents.rs.agent.with_lr`), to
``route``, which scatters equal shares to the followers; those run only the BC steps. A
roll-back's restored weights go to every rank through the route's ``sync_weights``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from agents.core import direct_route
from agents.rs.agent import (BCAgent, RejectionSamplingConfig, cosine_lr, keep_version, scheduled_lr,
                             with_lr)
from agents.rs.data import RSData
from agents.rs.jobs import EVAL_GROUP_BASE, EvalJobs
from data.core.jobs import Job

log = logging.getLogger("tandem.agents.rs")


@dataclass
class _Round:
    group: int
    candidate: int
    baseline: bool
    jobs: list[Job]
    started: float = field(default_factory=time.monotonic)
    results: dict[int, bool] = field(default_factory=dict)


class RSLearner:
    """The cadence of rejection sampling (module docstring); an :class:`agents.core.AlgoLearner`.

    ``version`` counts the versions this learner asked to publish; it equals the learner
    app's weights version (the app publishes exactly when :meth:`should_publish` says so,
    from version 0 or the checkpoint's)."""

    def __init__(self, cfg: RejectionSamplingConfig, agent: BCAgent, data: RSData, jobs: EvalJobs,
                 *, env_steps: Callable[[], int], horizon: int = 1):
        self.cfg, self.agent, self.data, self.jobs = cfg, agent, data, jobs
        self.route = direct_route
        self.policy = agent.policy
        self.env_steps = env_steps
        self.horizon = int(horizon)
        self._kw = {"horizon": self.horizon} if self.horizon > 1 else {}
        self.eval_jobs = cfg.eval_jobs()
        self.updates = self.sft_updates = self.pretrain_done = 0
        self.version = self.cycles = self.cycle_step = self.cycle_start = self.rounds = 0
        self.best: dict | None = None
        self.best_success = -math.inf
        self.best_version = 0
        self.counters: Counter[str] = Counter()
        self.history: list[dict] = []
        self._eval_steps_base = 0
        self._round: _Round | None = None
        self._lock = threading.Lock()
        self._publish = False
        if cfg.pretrain_steps > 0:
            self.phase = "pretrain"
        else:
            self.phase = "eval" if self.eval_jobs and cfg.eval_initial else "collect"
        self._baseline_pending = self.phase == "eval" or (self.phase == "pretrain" and cfg.eval_initial)
        if data.sink is not None:  # a follower rank's learner has no data (learner/distributed.py)
            data.sink.on_eval = self._on_eval
        data.rs_status = self.status

    # -- counters ------------------------------------------------------------------------------
    def online_steps(self) -> int:
        """Env steps stored, evaluation episodes excluded."""
        return int(self.env_steps()) - self._eval_steps_base - self.data.sink.counters["eval_steps"]

    def status(self) -> dict:
        with self._lock:
            rnd = self._round
            done = len(rnd.results) if rnd is not None else 0
        return {"phase": self.phase, "version": self.version, "updates": self.updates,
                "pretrain_steps": self.pretrain_done, "cycles": self.cycles,
                "online_steps": self.online_steps(), "cycle_start": self.cycle_start,
                "best_success": None if self.best_success == -math.inf else self.best_success,
                "best_version": self.best_version, "eval_done": done,
                "eval_pending": self.jobs.pending(), **dict(self.counters),
                "history": self.history[-50:]}

    # -- the cadence ---------------------------------------------------------------------------
    def should_publish(self) -> bool:
        return self._publish

    def _publish_version(self) -> None:
        self._publish = True
        self.version += 1

    def step(self) -> dict[str, float] | None:
        self._publish = False
        if self.phase == "pretrain":
            return self._pretrain_step()
        if self.phase == "eval":
            return self._eval_step()
        if self.phase == "collect":
            online = self.online_steps()
            if online - self.cycle_start < self.cfg.env_steps_per_cycle:
                return None
            self.cycle_start = online
            if len(self.data.sampler) == 0:
                self.counters["skipped_cycles"] += 1
                return None
            self.phase, self.cycle_step = "train", 0
        lr = scheduled_lr(self.cfg, self.cycle_step, self.sft_updates)
        t0 = time.perf_counter()
        batch = self.data.sampler.sample(self.cfg.batch_size, **self._kw)
        sample_s = time.perf_counter() - t0
        m = self._update(batch, lr)
        m["sample_s"] = sample_s
        self.updates += 1
        self.sft_updates += 1
        self.cycle_step += 1
        if self.cycle_step >= self.cfg.sft_steps_per_cycle:
            self.cycles += 1
            self._publish_version()
            self._next_after_publish(baseline=False)
        m.update(cycle=float(self.cycles), success_store=float(len(self.data.success)))
        return m

    def _pretrain_step(self) -> dict[str, float]:
        demo = self.data.demo
        lr = cosine_lr(self.pretrain_done, self.cfg.pretrain_steps, self.cfg.lr, self.cfg.lr_min)
        m = self._update(demo.sample(self.cfg.batch_size, **self._kw), lr)
        self.pretrain_done += 1
        self.updates += 1
        if self.pretrain_done >= self.cfg.pretrain_steps:
            self._publish_version()
            log.info("pretrained on the demos for %d steps: version %d", self.pretrain_done, self.version)
            self._next_after_publish(baseline=self.cfg.eval_initial)
        m["pretrain_step"] = float(self.pretrain_done)
        return m

    def _update(self, batch: dict, lr: float) -> dict[str, float]:
        """One BC step on the global ``batch`` through ``route`` (N ranks: scattered, the lr
        with it); the demos' share is the whole batch's."""
        m = self.agent.update(self.route(with_lr(batch, lr)))
        if "is_demo" in batch:
            m["demo_fraction"] = float(batch["is_demo"].float().mean())
        return m

    def _next_after_publish(self, *, baseline: bool) -> None:
        self.phase = "eval" if self.eval_jobs else "collect"
        self._baseline_pending = baseline
        self.cycle_step = 0

    def _start_round(self) -> None:
        group = EVAL_GROUP_BASE + self.rounds
        self.rounds += 1
        jobs = [Job(job_id=i, task_id=t, init_state=s, seed=self.cfg.eval_seed, group_id=group,
                    deterministic=True) for i, (t, s) in enumerate(self.eval_jobs)]
        with self._lock:
            self._round = _Round(group, self.version, self._baseline_pending, jobs)
        self.jobs.start(jobs)
        log.info("evaluating version %d: %d deterministic episodes", self.version, len(jobs))

    def _on_eval(self, actor: str, episode: int, group: int, ok: bool, min_version: float,
                 intervened: int) -> None:
        """A finished evaluation episode (ingest's thread)."""
        with self._lock:
            rnd = self._round
            if rnd is None or group != rnd.group:
                return
            job = self.jobs.job_of(actor, episode)
            if job is None or job.job_id in rnd.results:
                return
            if min_version < rnd.candidate:  # begun before the candidate reached the actor
                self.counters["stale_eval_episodes"] += 1
                self.jobs.put(job)
                return
            rnd.results[job.job_id] = bool(ok) and not intervened

    def _eval_step(self) -> dict[str, float] | None:
        if self._round is None:
            self._start_round()
            return None
        rnd = self._round
        with self._lock:
            results = dict(rnd.results)
        timed_out = time.monotonic() - rnd.started > self.cfg.eval_timeout_s
        if len(results) < len(rnd.jobs) and not timed_out:
            return None
        self.jobs.clear()
        with self._lock:
            self._round = None
        if timed_out:
            self.counters["eval_timeouts"] += 1
        success = float(np.mean(list(results.values()))) if results else float("nan")
        decision = self._decide(rnd, success, bool(results))
        self.history.append({"version": rnd.candidate, "success": None if not results else success,
                             "episodes": len(results), "decision": decision,
                             "online_steps": self.online_steps(), "updates": self.updates,
                             "online_episodes": int(self.data.sink.counters["episodes"]),
                             "kept_episodes": int(self.data.sink.counters["kept_episodes"]),
                             "success_store": len(self.data.success)})
        log.info("version %d: success %.2f over %d evaluation episodes -> %s (best %.2f, v%d)",
                 rnd.candidate, success, len(results), decision, self.best_success, self.best_version)
        self.phase, self.cycle_step = "collect", 0
        return {"eval_success": success, "eval_episodes": float(len(results)),
                "best_success": self.best_success, "rollbacks": float(self.counters["rollbacks"])}

    def _decide(self, rnd: _Round, success: float, have: bool) -> str:
        if rnd.baseline or self.best is None:
            self.best, self.best_version = self.agent.trainable(), rnd.candidate
            self.best_success = success if have else -math.inf
            return "baseline"
        if not have:
            return "kept (no evaluation episodes)"
        if keep_version(success, self.best_success, self.cfg.eval_tolerance):
            self.counters["kept"] += 1
            if success >= self.best_success:
                self.best, self.best_success = self.agent.trainable(), success
                self.best_version = rnd.candidate
            return "kept"
        self.counters["rollbacks"] += 1
        self.agent.load_trainable(self.best)
        if self.cfg.reset_optimizer_on_rollback:
            self.agent.reset_optimizer()
        sync = getattr(self.route, "sync_weights", None)
        if sync is not None:  # N ranks: every rank takes rank 0's restored weights (and reset)
            sync(self.policy, reset_optimizer=bool(self.cfg.reset_optimizer_on_rollback))
        self._publish_version()
        return f"rolled back to v{self.best_version} (published as v{self.version})"

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        keys = ("updates", "sft_updates", "pretrain_done", "version", "cycles", "cycle_step",
                "cycle_start", "rounds", "best_success", "best_version", "phase")
        st = {k: getattr(self, k) for k in keys}
        st.update(agent=self.agent.state_dict(), best=self.best, counters=dict(self.counters),
                  history=list(self.history), baseline_pending=self._baseline_pending,
                  eval_steps=self._eval_steps_base + self.data.sink.counters["eval_steps"])
        return st

    def load_state_dict(self, state: dict) -> None:
        """Resume; an evaluation that was under way starts again (a new round of jobs)."""
        self.agent.load_state_dict(state["agent"])
        for k in ("updates", "sft_updates", "pretrain_done", "version", "cycles", "cycle_step",
                  "cycle_start", "rounds", "best_version"):
            setattr(self, k, int(state[k]))
        self.best_success = float(state["best_success"])
        self.phase = str(state["phase"])
        self.best = state["best"]
        self.counters = Counter(state["counters"])
        self.history = list(state["history"])
        self._baseline_pending = bool(state["baseline_pending"])
        seen = self.data.sink.counters["eval_steps"] if self.data.sink is not None else 0
        self._eval_steps_base = int(state["eval_steps"]) - seen
        self._round = None
