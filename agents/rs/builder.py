"""Rejection sampling's builder (:class:`agents.base.Builder`): its data (the replay ring,
refilled from the LeRobot episode store, with an outcome-scoring sink in front and the
success store as a view of it; demos mixed in), its evaluation jobs and its cadence.

Cadence (:class:`RSLearner`, Hi-ORS):

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

The success store is :class:`data.sampler.SuccessView` over the replay: transitions of
episodes whose outcome is a success (:func:`agents.rs.agent.episode_outcome`;
:class:`OutcomeSink` writes it into the buffer's copy of each episode's final record) plus
intervened steps, evaluation episodes held out. A restarted learner refills the replay
from the dataset through the same sink, so the store comes back as it was.

``RSData.status()`` (``status.json`` -> ``replay``) reports the store and, under ``rs``,
the learner's phase, counters and evaluation history.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from agents.base import check_pair
from agents.rs.agent import (BCAgent, RejectionSamplingConfig, cosine_lr,
                                       episode_outcome, keep_version, scheduled_lr)
from data.core.jobs import Job
from data.core.spec import EnvSpec
from data.sampler import MixedSampler, Replay, SuccessView, build_replay, groups_from
from data.transitions import TransitionBatch

log = logging.getLogger("tandem.agents.rs")

#: evaluation jobs carry group ids from here on (round r: EVAL_GROUP_BASE + r)
EVAL_GROUP_BASE = 1 << 30


class EvalJobs:
    """The learner's job source (``next_job(actor_id, episode)``, thread-safe): the current
    evaluation round's jobs, one per episode start; None while there are none. An actor that
    asks again for the same episode gets the same job."""

    def __init__(self, max_assigned: int = 65536):
        self._lock = threading.Lock()
        self._queue: deque[Job] = deque()
        self._assigned: OrderedDict[tuple[str, int], Job] = OrderedDict()
        self.max_assigned = int(max_assigned)

    def start(self, jobs: list[Job]) -> None:
        with self._lock:
            self._queue = deque(jobs)

    def put(self, job: Job) -> None:
        with self._lock:
            self._queue.append(job)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def next_job(self, actor_id: str, episode: int) -> Job | None:
        key = (str(actor_id), int(episode))
        with self._lock:
            job = self._assigned.get(key)
            if job is not None or not self._queue:
                return job
            job = self._assigned[key] = self._queue.popleft()
            while len(self._assigned) > self.max_assigned:
                self._assigned.popitem(last=False)
            return job

    def job_of(self, actor_id: str, episode: int) -> Job | None:
        with self._lock:
            return self._assigned.get((str(actor_id), int(episode)))


class OutcomeSink:
    """Ingest's sink: decides each finished episode's outcome, writes it into the buffer's
    copy of its final record's ``success`` (the dataset keeps the env's flag), adds the
    records to the replay buffer, counts, and reports finished evaluation episodes
    (``on_eval(actor_id, episode, group_id, success, min_policy_version, intervened)``)."""

    def __init__(self, buffer, cfg: RejectionSamplingConfig):
        self.buffer = buffer
        self.cfg = cfg
        self.on_eval: Callable[..., None] | None = None
        self.counters: Counter[str] = Counter()
        self._open: dict[tuple[str, int], list] = {}  # -> [return, min version, intervened steps]
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.buffer.capacity

    @property
    def total_added(self) -> int:
        return self.buffer.total_added

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, batch: TransitionBatch, *, restored: bool = False) -> int:
        a = batch.arrays
        relabel = self.cfg.success_from != "success"
        success = a["success"].copy() if relabel else a["success"]
        ended = []
        with self._lock:
            for i in range(len(batch)):
                key = (batch.actor_id, int(a["episode"][i]))
                run = self._open.setdefault(key, [0.0, math.inf, 0])
                if not a["is_last"][i]:
                    run[0] += float(a["reward"][i])
                    run[1] = min(run[1], int(a["policy_version"][i]))
                    run[2] += bool(a["intervened"][i])
                    continue
                del self._open[key]
                ok = episode_outcome(bool(a["success"][i]), run[0], self.cfg)
                success[i] = ok
                ended.append((key, int(a["group_id"][i]), ok, run[1], run[2]))
        if relabel:
            batch = TransitionBatch(batch.actor_id, batch.first_seq, {**a, "success": success},
                                    batch.tasks)
        n = self.buffer.add(batch, restored=restored)
        if restored:
            return n
        steps = ~a["is_last"]
        eval_steps = int((steps & (a["group_id"] >= EVAL_GROUP_BASE)).sum())
        with self._lock:
            c = self.counters
            c["eval_steps"] += eval_steps
            c["intervened_steps"] += int((steps & a["intervened"]).sum())
            for _key, group, ok, _v, inter in ended:
                if group >= EVAL_GROUP_BASE:
                    c["eval_episodes"] += 1
                else:
                    c["episodes"] += 1
                    c["kept_episodes"] += ok
                    c["intervened_episodes"] += inter > 0
        for (actor, ep), group, ok, version, inter in ended:
            if group >= EVAL_GROUP_BASE and self.on_eval is not None:
                self.on_eval(actor, ep, group, ok, version, inter)
        return n

    def abandon(self, actor_id: str, episode: int) -> None:
        with self._lock:
            self._open.pop((actor_id, int(episode)), None)
        self.buffer.abandon(actor_id, episode)


@dataclass
class RSData:
    replay: Replay
    sink: OutcomeSink
    success: SuccessView
    sampler: Any
    demo: Any = None
    rs_status: Callable[[], dict] | None = None
    train: bool = True

    @property
    def store(self):
        return self.replay.store

    def status(self) -> dict:
        st = self.replay.status()
        st.update(success_store=len(self.success),
                  success_store_intervened=self.success.count_intervened(),
                  **{k: int(v) for k, v in self.sink.counters.items()})
        if self.rs_status is not None:
            st["rs"] = self.rs_status()
        return st

    def close(self, timeout: float = 30.0) -> None:
        self.replay.close(timeout)


class _Override:
    """A config section with some keys replaced (``get`` only, as build_replay reads it)."""

    def __init__(self, cfg, **over):
        self.cfg, self.over = cfg, over

    def get(self, key, default=None):
        if key in self.over:
            return self.over[key]
        get = self.cfg.get if hasattr(self.cfg, "get") else (lambda k, d=None: getattr(self.cfg, k, d))
        return get(key, default)


@dataclass
class _Round:
    group: int
    candidate: int
    baseline: bool
    jobs: list[Job]
    started: float = field(default_factory=time.monotonic)
    results: dict[int, bool] = field(default_factory=dict)


class RSLearner:
    """The cadence of rejection sampling (module docstring); an :class:`agents.base.AlgoLearner`.

    ``version`` counts the versions this learner asked to publish; it equals the learner
    app's weights version (the app publishes exactly when :meth:`should_publish` says so,
    from version 0 or the checkpoint's)."""

    def __init__(self, cfg: RejectionSamplingConfig, agent: BCAgent, data: RSData, jobs: EvalJobs,
                 *, env_steps: Callable[[], int], horizon: int = 1):
        self.cfg, self.agent, self.data, self.jobs = cfg, agent, data, jobs
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
        m = self.agent.update(batch, lr)
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
        m = self.agent.update(demo.sample(self.cfg.batch_size, **self._kw), lr)
        self.pretrain_done += 1
        self.updates += 1
        if self.pretrain_done >= self.cfg.pretrain_steps:
            self._publish_version()
            log.info("pretrained on the demos for %d steps: version %d", self.pretrain_done, self.version)
            self._next_after_publish(baseline=self.cfg.eval_initial)
        m["pretrain_step"] = float(self.pretrain_done)
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
        self._eval_steps_base = int(state["eval_steps"]) - self.data.sink.counters["eval_steps"]
        self._round = None


class RejectionSamplingBuilder:
    name = "rejection_sampling"

    def __init__(self, cfg: RejectionSamplingConfig):
        self.cfg = cfg
        self._jobs: EvalJobs | None = None

    @property
    def requires(self) -> tuple[type, ...]:
        return self.cfg.requires

    def make_networks(self, spec: EnvSpec, policy, device) -> SimpleNamespace:
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        return SimpleNamespace(spec=spec, policy=policy)

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> RSData:
        get = replay_cfg.get if hasattr(replay_cfg, "get") else (lambda k, d=None: getattr(replay_cfg, k, d))
        rep = build_replay(_Override(replay_cfg, refill=False), spec, run_dir=run_dir, seed=seed,
                           device=device, train=train)
        sink = OutcomeSink(rep.buffer, self.cfg)
        if train and rep.store is not None and get("refill", True):
            rep.store.load_into(sink)  # through the sink: outcomes decided as on arrival
        exclude = None if self.cfg.train_on_eval else groups_from(EVAL_GROUP_BASE)
        success = SuccessView(rep.buffer, include_interventions=self.cfg.keep_interventions,
                              exclude=exclude)
        sampler: Any = success
        if rep.demo is not None:
            ratio = self.cfg.demo_ratio if self.cfg.demo_ratio is not None else float(get("demo_ratio", 0.5))
            sampler = MixedSampler(success, rep.demo, demo_ratio=ratio)
        return RSData(rep, sink, success, sampler, rep.demo, train=train)

    def make_learner(self, networks, data: RSData, accelerator, *,
                     env_steps: Callable[[], int]) -> RSLearner:
        if self.cfg.pretrain_steps > 0 and data.train and data.demo is None:
            raise ValueError("algo=rejection_sampling: pretrain_steps > 0 needs demonstrations "
                             "(buffer.demos=<LeRobot dataset>, e.g. from tools/record_demos.py)")
        agent = BCAgent(self.cfg, networks.policy, accelerator)
        self._jobs = EvalJobs() if data.train and self.cfg.eval_jobs() else None
        return RSLearner(self.cfg, agent, data, self._jobs or EvalJobs(), env_steps=env_steps,
                         horizon=int(getattr(networks.policy, "chunk_size", 1)))

    def jobs(self):
        return self._jobs
