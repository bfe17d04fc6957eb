"""A thread-safe queue of learner jobs: the episodes the learner hands actors, in order.

The service calls :meth:`JobQueue.next_job` from its socket thread when an actor asks
(``get_job``) before resetting its env for episode ``episode``; the trainer (or a builder's
job source) may :meth:`put` / :meth:`extend` from another thread at any time.

An actor that asks again for the same episode (its reply was lost and it retried, or it
reconnected) gets the same job again, not the next one: ``assigned[(actor_id, episode)]``
remembers what each episode was given (the newest ``max_assigned`` of them). A job whose
reply never reached its actor (the actor gave up waiting and ran its own episode) is not
put back: the records of that episode carry ``group_id = -1``, so a consumer that waits for
a whole group can tell that it is incomplete.

``jobs: [...]`` in the learner config is a static list (:meth:`JobQueue.from_config`); each
entry holds :class:`data.core.jobs.Job` fields (``job_id`` defaults to the entry's index).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import fields
from typing import Any, Iterable, Mapping

from data.core.jobs import Job

_JOB_FIELDS = tuple(f.name for f in fields(Job))


class JobQueue:
    def __init__(self, jobs: Iterable[Job] = (), *, max_assigned: int = 65536):
        self._lock = threading.Lock()
        self._queue: deque[Job] = deque()
        self.assigned: OrderedDict[tuple[str, int], Job] = OrderedDict()
        self.max_assigned = int(max_assigned)
        self.extend(jobs)

    def put(self, job: Job) -> None:
        if not isinstance(job, Job):
            raise TypeError(f"expected a Job, got {type(job).__name__}")
        with self._lock:
            self._queue.append(job)

    def extend(self, jobs: Iterable[Job]) -> None:
        jobs = list(jobs)
        for job in jobs:
            if not isinstance(job, Job):
                raise TypeError(f"expected a Job, got {type(job).__name__}")
        with self._lock:
            self._queue.extend(jobs)

    def next_job(self, actor_id: str, episode: int) -> Job | None:
        """The job for ``actor_id``'s episode ``episode``: the one it was already given, else
        the next queued job (removed from the queue), else None (run as you like)."""
        key = (str(actor_id), int(episode))
        with self._lock:
            job = self.assigned.get(key)
            if job is not None:
                return job
            if not self._queue:
                return None
            job = self._queue.popleft()
            self.assigned[key] = job
            while len(self.assigned) > self.max_assigned:
                self.assigned.popitem(last=False)
            return job

    def pending(self) -> int:
        """Jobs not yet handed out."""
        with self._lock:
            return len(self._queue)

    @classmethod
    def from_config(cls, entries: Iterable[Mapping[str, Any]] | None) -> "JobQueue":
        """``[{"task_id": 0, "init_state": 3, "seed": 7, "group_id": 1}, ...]`` -> a queue.
        Unknown keys and bad values are errors naming the entry."""
        jobs = []
        for i, entry in enumerate(entries or ()):
            try:
                d = dict(entry)
            except (TypeError, ValueError):
                raise ValueError(f"jobs[{i}]: expected a mapping of job fields, got {entry!r}") from None
            unknown = sorted(set(d) - set(_JOB_FIELDS))
            if unknown:
                raise ValueError(f"jobs[{i}]: unknown key(s) {unknown}; valid: {list(_JOB_FIELDS)}")
            d.setdefault("job_id", i)
            if "deterministic" in d and not isinstance(d["deterministic"], bool):
                raise ValueError(f"jobs[{i}]: deterministic must be true or false")
            try:
                jobs.append(Job(**d))
            except ValueError as exc:
                raise ValueError(f"jobs[{i}]: {exc}") from None
        return cls(jobs)
