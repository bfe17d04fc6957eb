"""GRPO's job scheduling and round collection: :class:`GroupJobSource` hands out the
groups' jobs to actors, :class:`GroupRounds` turns finished groups into update batches.
Each round, :class:`GroupJobSource` picks ``batch_groups`` (task, initial state) pairs -- tasks
in turn from ``task_ids``, initial states at random from ``range(num_init_states)`` (0: any)
-- and issues ``group_size`` jobs for each, all with the group's own ``group_id`` (and a
reset seed of their own, or one per group: ``seeds``). With ``estimator="remax"`` each group
gets one more job, deterministic: the greedy rollout whose score is the group's baseline.
Jobs go to whichever actors ask (``next_job(actor_id, episode)``, from the service's socket
thread); ``prefetch_rounds`` rounds may be issued ahead of the one the learner waits for, so
actors stay busy while it updates (their episodes are then up to that many versions stale,
hence ``max_staleness >= prefetch_rounds``). A round is closed once its update is
published, so the next one is issued to the new policy.

The rollout queue tells the source when an episode finishes or is abandoned (its
listeners); the source knows which job each (actor, episode) ran. A job is done when its
episode finishes carrying the job's group id. It is handed out again when its episode was
abandoned, finished without the group id (the actor never got the job), or has not finished
``job_timeout_s`` after it was handed out (the actor vanished); if both copies finish, the
surplus episode is dropped.

The learner (:class:`GroupRounds`) waits for the oldest open round: when each of its groups
holds ``group_size`` fresh episodes it takes them all; after ``round_timeout_s`` it takes
the groups holding at least ``min_group_size`` and gives up on the rest. A group whose jobs
are all done but whose episodes went missing (dropped as stale, or by the queue's bound) has
that many of its jobs run again (``rerun``), so it does not wait for the timeout. Episodes no open
round waits for (run without a job, or late for a closed round) are dropped and counted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from agents.grpo.agent import group_advantages
from agents.grpo.config import GRPOBuilderConfig
from agents.ppo.on_policy import Round, chunk_batch, episode_metrics, ppo_batch
from data.core.jobs import MAX_JOB_INT, Job
from data.rollouts import RolloutEpisode, RolloutQueue


@dataclass
class JobRound:
    round_id: int
    groups: list[int]
    started: float
    jobs: dict[int, Job] = field(default_factory=dict)   # job_id -> job
    done: set[int] = field(default_factory=set)          # job ids


class GroupJobSource:
    """Issues rounds of job groups, hands them out, reissues lost ones (module docstring).
    Thread-safe: ``next_job`` runs on the service thread, the listeners on ingest's, the
    round calls on the learner's."""

    def __init__(self, cfg: GRPOBuilderConfig, *, clock: Callable[[], float] = time.monotonic,
                 max_assigned: int = 65536):
        self.cfg = cfg
        self.clock = clock
        self.rng = np.random.default_rng(cfg.jobs_seed)
        self.rounds: OrderedDict[int, JobRound] = OrderedDict()
        self.pending: deque[Job] = deque()
        self.assigned: OrderedDict[tuple[str, int], Job] = OrderedDict()
        self.max_assigned = int(max_assigned)
        self.out: dict[int, tuple[tuple[str, int], float]] = {}  # job_id -> (holder, when)
        self.counters = {"rounds": 0, "jobs": 0, "handed_out": 0, "reissued": 0, "done": 0,
                         "rerun": 0}
        self._next = {"round": 0, "group": 0, "job": 0, "task": 0}
        self._job_round: dict[int, int] = {}
        self._lock = threading.Lock()

    # ---- issuing -------------------------------------------------------------------------
    def _id(self, kind: str) -> int:
        v = self._next[kind]
        self._next[kind] = (v + 1) % (MAX_JOB_INT + 1)
        return v

    def _new_round(self) -> JobRound:
        cfg = self.cfg
        rnd = JobRound(self._id("round"), [], self.clock())
        for _ in range(cfg.batch_groups):
            gid = self._id("group")
            task = int(cfg.task_ids[self._next["task"] % len(cfg.task_ids)])
            self._next["task"] += 1
            hi = cfg.num_init_states or MAX_JOB_INT
            init = int(self.rng.integers(0, hi))
            shared = int(self.rng.integers(0, MAX_JOB_INT))
            for k in range(cfg.jobs_per_group):
                seed = shared if cfg.seeds == "shared" else int(self.rng.integers(0, MAX_JOB_INT))
                job = Job(self._id("job"), task_id=task, init_state=init, seed=seed, group_id=gid,
                          deterministic=k == cfg.group_size)  # remax: the last one is greedy
                rnd.jobs[job.job_id] = job
                self._job_round[job.job_id] = rnd.round_id
                self.pending.append(job)
            rnd.groups.append(gid)
        self.rounds[rnd.round_id] = rnd
        self.counters["rounds"] += 1
        self.counters["jobs"] += len(rnd.jobs)
        return rnd

    def _reissue(self, *job_ids: int) -> None:
        """Put handed-out jobs back at the front, in the given order (lock held)."""
        again = []
        for job_id in job_ids:
            if self.out.pop(job_id, None) is None:
                continue
            rnd = self.rounds.get(self._job_round.get(job_id, -1))
            if rnd is not None and job_id not in rnd.done:
                again.append(rnd.jobs[job_id])
        self.pending.extendleft(reversed(again))
        self.counters["reissued"] += len(again)

    def next_job(self, actor_id: str, episode: int) -> Job | None:
        """The job for ``actor_id``'s episode ``episode`` (the same one if it asks again)."""
        key = (str(actor_id), int(episode))
        with self._lock:
            job = self.assigned.get(key)
            if job is not None:
                return job
            now = self.clock()
            self._reissue(*[j for j, (_, when) in self.out.items()  # oldest first
                            if now - when > self.cfg.job_timeout_s])
            if not self.pending and len(self.rounds) <= self.cfg.prefetch_rounds:
                self._new_round()
            if not self.pending:
                return None
            job = self.pending.popleft()
            self.assigned[key] = job
            while len(self.assigned) > self.max_assigned:
                self.assigned.popitem(last=False)
            self.out[job.job_id] = (key, now)
            self.counters["handed_out"] += 1
            return job

    # ---- rollout queue listeners -----------------------------------------------------------
    def episode_finished(self, ep: RolloutEpisode) -> None:
        with self._lock:
            job = self.assigned.get(ep.key)
            if job is None:
                return
            if ep.group_id != job.group_id:  # the actor never got the job: run it elsewhere
                self._reissue(job.job_id)
                return
            self.out.pop(job.job_id, None)
            rnd = self.rounds.get(self._job_round.get(job.job_id, -1))
            if rnd is not None and job.job_id not in rnd.done:
                rnd.done.add(job.job_id)
                self.counters["done"] += 1
                try:  # a reissued copy not handed out yet is not needed any more
                    self.pending.remove(job)
                except ValueError:
                    pass

    def episode_abandoned(self, actor_id: str, episode: int) -> None:
        with self._lock:
            job = self.assigned.get((str(actor_id), int(episode)))
            if job is not None and self.out.get(job.job_id, (None,))[0] == (actor_id, episode):
                self._reissue(job.job_id)

    # ---- the learner's side ------------------------------------------------------------------
    def current_round(self) -> JobRound | None:
        """The oldest open round (None before any actor asked for a job)."""
        with self._lock:
            return next(iter(self.rounds.values()), None)

    def open_groups(self) -> set[int]:
        with self._lock:
            return {g for r in self.rounds.values() for g in r.groups}

    def held_by(self, actor_id: str) -> dict[int, int]:
        """job id -> round id of the jobs ``actor_id`` holds (handed out, not finished)."""
        with self._lock:
            return {j: self._job_round[j] for j, (key, _) in self.out.items()
                    if key[0] == actor_id and j in self._job_round}

    def is_baseline(self, key: tuple[str, int]) -> bool:
        """Whether (actor, episode) ran a deterministic (greedy baseline) job."""
        with self._lock:
            job = self.assigned.get(key)
            return bool(job is not None and job.deterministic)

    def rerun(self, short: dict[int, int]) -> int:
        """For each group id -> missing episodes: hand out again as many of the group's done
        jobs as are missing beyond those pending or handed out. Returns how many."""
        n = 0
        with self._lock:
            for rnd in self.rounds.values():
                for gid in set(short) & set(rnd.groups):
                    jobs = [j for j in rnd.jobs.values() if j.group_id == gid]
                    flying = sum(j in self.pending or j.job_id in self.out for j in jobs)
                    again = [j for j in jobs if j.job_id in rnd.done][:max(0, short[gid] - flying)]
                    for j in again:
                        rnd.done.discard(j.job_id)
                    self.pending.extendleft(reversed(again))  # before later rounds' jobs
                    n += len(again)
            self.counters["rerun"] += n
        return n

    def close_round(self, round_id: int) -> None:
        """The learner is done with the round: forget its jobs, hand none of them out."""
        with self._lock:
            rnd = self.rounds.pop(round_id, None)
            if rnd is None:
                return
            self.pending = deque(j for j in self.pending if j.job_id not in rnd.jobs)
            for job_id in rnd.jobs:
                self.out.pop(job_id, None)
                self._job_round.pop(job_id, None)

    def state_dict(self) -> dict:
        """The id counters: a restarted learner must not reuse the group ids of episodes that
        actors still resend from their spools."""
        with self._lock:
            return {"next": dict(self._next), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._next.update({k: int(v) for k, v in state.get("next", {}).items()})
            self.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})

    def status(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "open_rounds": len(self.rounds), "pending": len(self.pending),
                    "outstanding": len(self.out)}


class GroupRounds:
    """GRPO's collector: the job source's rounds, advantages within groups."""

    def __init__(self, queue: RolloutQueue, source: GroupJobSource, cfg: GRPOBuilderConfig, *,
                 horizon: int, clock: Callable[[], float] = time.monotonic):
        self.queue, self.source, self.cfg = queue, source, cfg
        self.horizon = int(horizon)
        self.clock = clock
        self.counters = {"groups_used": 0, "groups_dynamic_dropped": 0, "groups_incomplete": 0,
                         "rounds_timed_out": 0}

    def _score(self, ep: RolloutEpisode) -> float:
        return float(ep.success) if self.cfg.score == "success" else float(ep.ret)

    def collect(self, current_version: int) -> Round | None:
        rnd = self.source.current_round()
        if rnd is None:
            return None
        open_groups = self.source.open_groups()
        self.queue.prune(lambda e: e.group_id >= 0, "ungrouped")
        self.queue.prune(lambda e: e.group_id in open_groups, "orphan")
        size = self.cfg.jobs_per_group
        counts = self.queue.group_counts(current_version=current_version)
        short = {g: size - counts.get(g, 0) for g in rnd.groups if counts.get(g, 0) < size}
        timed_out = self.clock() - rnd.started > self.cfg.round_timeout_s
        if short and not timed_out:
            # episodes of done jobs that went missing (dropped stale or by the queue's bound)
            # are run again, so that the round completes without waiting for its timeout
            self.source.rerun(short)
            return None
        complete = not short
        groups = self.queue.take_groups(size, current_version=current_version, groups=rnd.groups,
                                        min_size=size if complete else self.cfg.min_group_size)
        done = lambda: self.source.close_round(rnd.round_id)  # noqa: E731 - once published
        self.counters["rounds_timed_out"] += int(not complete)
        self.counters["groups_incomplete"] += len(rnd.groups) - sum(len(g) == size for g in groups)
        episodes, baselines = self._split(groups)
        m = episode_metrics(episodes, current_version=current_version)
        m.update(round_id=float(rnd.round_id), round_groups=float(len(rnd.groups)),
                 round_timed_out=float(not complete))
        if not episodes:
            return Round(None, self._metrics(m), done)
        scores = torch.tensor([self._score(e) for e in episodes], dtype=torch.float32)
        gids = torch.tensor([e.group_id for e in episodes], dtype=torch.long)
        base = None if baselines is None else torch.tensor(baselines, dtype=torch.float32)
        adv, keep, dropped = group_advantages(self.cfg, scores, gids, base)
        self.counters["groups_dynamic_dropped"] += int(dropped)
        self.counters["groups_used"] += int(torch.unique(gids[keep]).numel())
        m.update(round_dynamic_dropped_groups=float(dropped), round_kept_episodes=float(keep.sum()))
        if not bool(keep.any()):
            return Round(None, self._metrics(m), done)
        kept = [e for e, k in zip(episodes, keep.tolist()) if k]
        cb = chunk_batch(kept, horizon=self.horizon, gamma=1.0)
        m.update(round_chunks=float(len(cb)), round_policy_chunks=float(cb.policy_mask.sum()))
        return Round(ppo_batch(cb, adv[keep][cb.row], episode_mean=self.cfg.loss_agg == "episode_mean"),
                     self._metrics(m), done)

    def _split(self, groups: list[list[RolloutEpisode]]):
        """(sampled episodes, the baseline score of each or None). With remax a group's
        greedy episode is its baseline, and a group without one is skipped."""
        if self.cfg.estimator != "remax":
            return [e for g in groups for e in g], None
        episodes, baselines = [], []
        for g in groups:
            greedy = [e for e in g if self.source.is_baseline(e.key)]
            sampled = [e for e in g if not self.source.is_baseline(e.key)]
            if not greedy or len(sampled) < 2:
                self.counters["groups_incomplete"] += 1
                continue
            episodes += sampled
            baselines += [self._score(greedy[0])] * len(sampled)
        return episodes, baselines

    def _metrics(self, m: dict[str, float]) -> dict[str, float]:
        m.update({k: float(v) for k, v in self.counters.items()})
        m.update({f"jobs_{k}": float(v) for k, v in self.source.status().items()})
        return m

    def state_dict(self) -> dict:
        return {"counters": dict(self.counters), "source": self.source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state.get("counters", {}))
        self.source.load_state_dict(state.get("source", {}))
