"""The episode store's background writer: a queue of finished episodes, grouped into
commits, retried with backoff when a commit fails."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable, Sequence

from data.store.episode import Episode

log = logging.getLogger("tandem.data.store")


class CommitWorker:
    """Queue and writer thread; a subclass provides :meth:`write` (one commit, rolled back
    when it raises) and :meth:`_report_failure`.

    ``submit(episode)`` queues; the thread groups whatever is queued into one commit (at most
    ``max_episodes_per_commit``; at most one commit per ``commit_interval_s``, unless a whole
    commit's worth is already queued: then the next one starts at once, so that the interval
    never caps the store at ``max_episodes_per_commit / commit_interval_s`` episodes per second
    while actors produce more), then calls ``on_durable(durable, dropped)``. A failed commit's episodes go back to the front of the
    queue and are retried after a backoff between ``retry_min_s`` and ``retry_max_s``.
    """

    def __init__(self, *, label: str, commit_interval_s: float = 0.0,
                 max_episodes_per_commit: int = 32, retry_min_s: float = 1.0,
                 retry_max_s: float = 60.0):
        self._label = label
        self.commit_interval_s = float(commit_interval_s)
        self.max_episodes_per_commit = max(1, int(max_episodes_per_commit))
        self.retry_min_s = float(retry_min_s)
        self.retry_max_s = float(retry_max_s)
        self.on_durable: Callable[[list[Episode], list[Episode]], None] | None = None
        self.counters: Counter[str] = Counter()
        self.last_error: str | None = None
        self._cv = threading.Condition()
        self._queue: deque[Episode] = deque()
        self._writing = 0
        self._submitted = 0  # episodes queued so far
        self._settled = 0    # of those, written or dropped (commits are in submission order)
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- to be provided by the store -------------------------------------------------------

    def write(self, episodes: Sequence[Episode]) -> tuple[list[Episode], list[Episode]]:
        raise NotImplementedError

    def _report_failure(self, exc: Exception, n: int, retry_s: float) -> None:
        raise NotImplementedError

    def _closed(self) -> None:
        """Called once the thread has stopped (release the dataset writer)."""

    def _prepare(self, episode: Episode) -> None:
        """Called for each submitted episode, on the submitting thread, after queueing it:
        start work that does not need the dataset (encoding, off this thread)."""

    # ---- the queue -------------------------------------------------------------------------

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-episode-store",
                                            daemon=True)
            self._thread.start()
        return self

    def submit(self, episode: Episode) -> None:
        """Queue a finished episode. After :meth:`close` it is not written (and so never
        acknowledged: the actor resends it to the next learner)."""
        with self._cv:
            if self._stop:
                log.info("episode store closed: episode %d of actor %s not written", episode.episode,
                         episode.actor_id)
                return
            self._queue.append(episode)
            self._submitted += 1
            self._cv.notify_all()
        self._prepare(episode)

    def status(self) -> dict:
        """Counters for status.json: committed episodes and frames, queue, write errors."""
        return {"dataset_episodes": self.total_episodes, "dataset_frames": self.total_frames,
                "dataset_pending": self.pending, "dataset_write_errors": self.counters["write_errors"],
                "dataset_error": self.last_error}

    @property
    def pending(self) -> int:
        """Episodes queued or being written (not yet durable)."""
        with self._cv:
            return len(self._queue) + self._writing

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every episode submitted before this call is durable or dropped; False on
        timeout. Episodes submitted meanwhile are not waited for: actors still sending (a
        learner stopping at ``max_updates``) would otherwise keep the queue from ever emptying
        and every close would wait out its whole timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            target = self._submitted
            self._cv.notify_all()
            while self._settled < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left if left is not None else 0.5)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued when called (up to ``timeout``), then stop. Episodes left
        unwritten (also those submitted during the wait) stay unacknowledged: actors resend
        them to the next learner."""
        if self._thread is not None:
            self.flush(timeout)
        with self._cv:
            self._stop = True
            left = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))
        if left:
            log.warning("episode store: %d finished episode(s) not written at shutdown; actors "
                        "resend them", left)
        self._closed()

    # ---- the thread ------------------------------------------------------------------------

    def _next_batch(self, last_commit: float) -> list[Episode] | None:
        """Wait for queued episodes (and the commit interval); None once stopped."""
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            # the rest of the interval (a submit's notify does not end it), unless a whole
            # commit's worth is queued
            while len(self._queue) < self.max_episodes_per_commit:
                wait = last_commit + self.commit_interval_s - time.monotonic()
                if wait <= 0:
                    break
                self._cv.wait(timeout=wait)
                if self._stop:
                    return None
            batch = [self._queue.popleft()
                     for _ in range(min(len(self._queue), self.max_episodes_per_commit))]
            self._writing = len(batch)
            return batch

    def _run(self) -> None:
        backoff = 0.0
        last_commit = 0.0
        while True:
            batch = self._next_batch(last_commit)
            if batch is None:
                return
            try:
                done, dropped = self.write(batch)
            except Exception as exc:
                backoff = min(self.retry_max_s, max(self.retry_min_s, 2 * backoff))
                self._report_failure(exc, len(batch), backoff)
                with self._cv:
                    self._queue.extendleft(reversed(batch))
                    self._writing = 0
                    self._cv.notify_all()
                    self._cv.wait(timeout=backoff)
                continue
            if backoff:
                log.warning("episode store: writing to %s works again", self._label)
                self.last_error = None
            backoff = 0.0
            last_commit = time.monotonic()
            try:
                if self.on_durable is not None:
                    self.on_durable(done, dropped)
            except Exception:  # pragma: no cover - a bug in the callback
                log.exception("episode store: on_durable callback failed")
            with self._cv:
                self._writing = 0
                self._settled += len(batch)
                self._cv.notify_all()
