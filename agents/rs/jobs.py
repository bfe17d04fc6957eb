"""Rejection sampling's evaluation jobs: the deterministic (task, init state) episodes of
an evaluation round, handed to actors as they ask (:class:`EvalJobs`); their group ids start at
:data:`EVAL_GROUP_BASE`."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from data.core.jobs import Job

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
