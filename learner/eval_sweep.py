"""Evaluation sweeps as jobs: every (task, initial state) of a suite run once, deterministically,
spread over whatever actors are connected (LIBERO's protocol: 50 initial states per task).

``eval.sweep`` in the learner config (``mode=eval``)::

    eval:
      sweep: {task_ids: 10, init_states: 50}      # tasks 0..9 x initial states 0..49

``task_ids`` is a count (tasks ``0..n-1``) or a list of task indices. Each job carries its own
``group_id`` (= its job id), so the episode that comes back names the job it ran. A job handed
out with no finished episode after ``job_timeout_s`` (its actor vanished or hangs) is queued
again; whichever episode of a job finishes first is the one counted, so a reissued job is
never counted twice. The sweep is done when every job has an outcome.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

from data.core.jobs import Job
from learner.jobs import JobQueue


def sweep_jobs(task_ids: int | list[int], init_states: int, *, seed: int = 0) -> list[Job]:
    """The sweep's jobs, task-major: job ``k`` is (task, init state), deterministic."""
    tasks = list(range(int(task_ids))) if isinstance(task_ids, int) else [int(t) for t in task_ids]
    if not tasks or int(init_states) < 1:
        raise ValueError(f"eval.sweep needs at least one task and init_states >= 1, got task_ids="
                         f"{task_ids!r}, init_states={init_states!r}")
    jobs = []
    for t in tasks:
        for i in range(int(init_states)):
            k = len(jobs)
            jobs.append(Job(k, task_id=t, init_state=i, seed=int(seed) + k, group_id=k, deterministic=True))
    return jobs


class EvalSweep:
    """The job source of an evaluation sweep and its tally (thread-safe: the socket thread
    hands out jobs and feeds records; the learner's main loop reissues and reports)."""

    def __init__(self, jobs: list[Job], *, job_timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.jobs = {j.group_id: j for j in jobs}
        self.queue = JobQueue(jobs)
        self.job_timeout_s = float(job_timeout_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._handed: dict[int, float] = {}  # group id -> when it was (last) handed out
        self._open: dict[tuple[str, int], dict] = {}  # (actor, episode) -> running tally
        self.results: dict[int, dict[str, Any]] = {}  # group id -> outcome of its first episode
        self.counters = {"handed_out": 0, "reissued": 0, "duplicates": 0, "foreign": 0}

    @classmethod
    def from_config(cls, sweep: Mapping[str, Any], **kw: Any) -> "EvalSweep":
        unknown = set(sweep) - {"task_ids", "init_states", "seed", "job_timeout_s"}
        if unknown:
            raise ValueError(f"eval.sweep: unknown keys {sorted(unknown)} (task_ids, init_states, "
                             f"seed, job_timeout_s)")
        task_ids = sweep.get("task_ids", 1)
        if not isinstance(task_ids, int):
            task_ids = [int(t) for t in task_ids]
        jobs = sweep_jobs(task_ids, int(sweep.get("init_states", 50)), seed=int(sweep.get("seed", 0)))
        return cls(jobs, job_timeout_s=float(sweep.get("job_timeout_s", 300.0)), **kw)

    @property
    def total(self) -> int:
        return len(self.jobs)

    @property
    def done(self) -> bool:
        with self._lock:
            return len(self.results) >= len(self.jobs)

    def next_job(self, actor_id: str, episode: int) -> Job | None:  # socket thread
        job = self.queue.next_job(actor_id, episode)
        if job is not None:
            with self._lock:
                if job.group_id not in self.results:
                    self._handed[job.group_id] = self.clock()
                self.counters["handed_out"] += 1
        return job

    def reissue_timed_out(self) -> int:
        """Queue again every job handed out over ``job_timeout_s`` ago with no outcome."""
        now = self.clock()
        with self._lock:
            late = [g for g, t in self._handed.items()
                    if g not in self.results and now - t > self.job_timeout_s]
            for g in late:
                self._handed[g] = now
            self.counters["reissued"] += len(late)
        self.queue.extend(self.jobs[g] for g in late)
        return len(late)

    def on_records(self, batch, keep: np.ndarray) -> None:  # socket thread, under ingest's lock
        a = batch.arrays
        with self._lock:
            for i in np.flatnonzero(np.asarray(keep, bool)):
                if bool(a["is_last"][i]):
                    continue
                key = (batch.actor_id, int(a["episode"][i]))
                tally = self._open.setdefault(key, {"group": int(a["group_id"][i]), "success": False,
                                                    "return": 0.0, "steps": 0, "task": batch.tasks[i]})
                tally["success"] = tally["success"] or bool(a["success"][i])
                tally["return"] += float(a["reward"][i])
                tally["steps"] += 1
                if bool(a["terminated"][i]) or bool(a["truncated"][i]):
                    self._finish(self._open.pop(key))
            while len(self._open) > 4096:  # abandoned episodes of vanished actors
                self._open.pop(next(iter(self._open)))

    def _finish(self, tally: dict) -> None:
        g = tally.pop("group")
        if g not in self.jobs:
            self.counters["foreign"] += 1  # an episode run without one of this sweep's jobs
        elif g in self.results:
            self.counters["duplicates"] += 1  # a reissued job's second episode
        else:
            job = self.jobs[g]
            self.results[g] = {**tally, "task_id": job.task_id, "init_state": job.init_state}

    def report(self) -> dict[str, Any]:
        """Success and return per task (keyed ``"<index>: <instruction>"``) and overall."""
        with self._lock:
            results = list(self.results.values())
            counters = dict(self.counters)
        per_task: dict[str, dict[str, Any]] = {}
        for t in sorted({r["task_id"] for r in results}):
            rs = [r for r in results if r["task_id"] == t]
            per_task[f"{t}: {rs[0]['task'] or 'default'}"] = {"task_id": t, "episodes": len(rs),
                                "success": float(np.mean([r["success"] for r in rs])),
                                "return": float(np.mean([r["return"] for r in rs])),
                                "failed_init_states": sorted(r["init_state"] for r in rs if not r["success"])}
        overall = {"episodes": len(results), "jobs": len(self.jobs),
                   "success": float(np.mean([r["success"] for r in results])) if results else float("nan"),
                   "return": float(np.mean([r["return"] for r in results])) if results else float("nan")}
        return {"overall": overall, "per_task": per_task, "counters": counters}
