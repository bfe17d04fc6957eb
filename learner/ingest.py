"""Ingest: per-actor sequence numbers, duplicate dropping, storage and episode statistics.

Each actor numbers its records 0, 1, 2, ... . ``received`` is the highest sequence number
stored for an actor; a batch that overlaps it is trimmed (duplicates after a resend are
dropped), one that leaves a gap is refused so that the actor resends from its ack.
``acked`` is what the store reports durable; the vertical slice's in-memory buffer is
durable as soon as it holds the records (the LeRobot-backed store acknowledges later).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from data.transitions import TransitionBatch, TransitionError

log = logging.getLogger("tandem.learner.ingest")


@dataclass
class EpisodeStats:
    """Finished-episode returns and successes, per task."""

    window: int = 100
    returns: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    successes: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    lengths: deque = field(default_factory=lambda: deque(maxlen=100))
    episodes: int = 0

    def add(self, task: str, ret: float, success: bool, length: int) -> None:
        for store, val in ((self.returns, ret), (self.successes, float(success))):
            dq = store[task]
            dq.append(val)
            while len(dq) > self.window:
                dq.popleft()
        self.lengths.append(length)
        self.episodes += 1

    def summary(self) -> dict[str, float]:
        all_r = [r for dq in self.returns.values() for r in dq]
        all_s = [s for dq in self.successes.values() for s in dq]
        if not all_r:
            return {"episodes": float(self.episodes)}
        return {
            "episodes": float(self.episodes),
            "return": float(np.mean(all_r)),
            "success": float(np.mean(all_s)),
            "length": float(np.mean(self.lengths)) if self.lengths else 0.0,
        }

    def per_task(self) -> dict[str, dict[str, float]]:
        return {
            t: {"episodes": len(self.returns[t]), "return": float(np.mean(self.returns[t])),
                "success": float(np.mean(self.successes[t]))}
            for t in sorted(self.returns)
        }


class Ingest:
    """Thread-safe front of the replay store; called from the service thread."""

    def __init__(self, buffer, *, store_transitions: bool = True, stats_window: int = 100):
        self.buffer = buffer
        self.store_transitions = store_transitions
        self.stats = EpisodeStats(window=stats_window)
        self.received: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        self.max_episode: dict[str, int] = {}
        self.rejections: Counter[str] = Counter()
        self.steps = 0  # env steps stored (is_last records excluded)
        self._running: dict[tuple[str, int], list] = {}  # (actor, episode) -> [return, success, len]
        self._lock = threading.Lock()

    def actor_position(self, actor_id: str) -> tuple[int, int]:
        """(acked sequence number or -1, next free episode id) for a (re)connecting actor."""
        with self._lock:
            return self.acked.get(actor_id, -1), self.max_episode.get(actor_id, -1) + 1

    def resync(self, actor_id: str, resend_from: int) -> None:
        """An actor can resend from ``resend_from`` on. Records it dropped because they were
        acknowledged, but that this learner no longer has (they were acknowledged by an
        earlier learner process after its last checkpoint), are gone: log it, skip them."""
        with self._lock:
            have = self.received.get(actor_id, -1)
            if resend_from > have + 1:
                log.warning(
                    "actor %s: records %d..%d were acknowledged before a learner restart and are "
                    "not in the restored state; continuing from %d",
                    actor_id, have + 1, resend_from - 1, resend_from,
                )
                self.received[actor_id] = resend_from - 1
                self.acked[actor_id] = resend_from - 1

    def skip(self, batch: TransitionBatch) -> int:
        """Consume a rejected batch's sequence numbers without storing it; returns the ack."""
        with self._lock:
            have = self.received.get(batch.actor_id, -1)
            if batch.first_seq <= have + 1 < batch.last_seq + 1:
                self.received[batch.actor_id] = batch.last_seq
                self.acked[batch.actor_id] = batch.last_seq
            return self.acked.get(batch.actor_id, -1)

    def count_rejection(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason.split(":")[0]] += 1

    def add(self, batch: TransitionBatch) -> tuple[int, int]:
        """Store new records of ``batch``; returns (acked seq, number of duplicates dropped)."""
        with self._lock:
            have = self.received.get(batch.actor_id, -1)
            if batch.first_seq > have + 1:
                raise TransitionError(
                    f"sequence gap: expected seq {have + 1}, batch starts at {batch.first_seq}"
                )
            dup = min(len(batch), have + 1 - batch.first_seq)
            if dup >= len(batch):
                return self.acked.get(batch.actor_id, -1), dup
            new = batch.slice(dup) if dup else batch
            if self.store_transitions:
                self.buffer.add(new)
            self.received[batch.actor_id] = new.last_seq
            self.acked[batch.actor_id] = new.last_seq
            self._track(new)
            return new.last_seq, dup

    def _track(self, b: TransitionBatch) -> None:
        a = b.arrays
        for i in range(len(b)):
            ep = int(a["episode"][i])
            key = (b.actor_id, ep)
            self.max_episode[b.actor_id] = max(self.max_episode.get(b.actor_id, -1), ep)
            if a["is_last"][i]:
                self._running.pop(key, None)
                continue
            self.steps += 1
            run = self._running.setdefault(key, [0.0, False, 0])
            run[0] += float(a["reward"][i])
            run[1] = run[1] or bool(a["success"][i])
            run[2] += 1
            if a["terminated"][i] or a["truncated"][i]:
                self.stats.add(b.tasks[i] or "default", run[0], run[1], run[2])
                self._running.pop(key, None)

    def state_dict(self) -> dict:
        with self._lock:
            return {"received": dict(self.received), "acked": dict(self.acked),
                    "max_episode": dict(self.max_episode), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.received = {k: int(v) for k, v in state.get("received", {}).items()}
            self.acked = {k: int(v) for k, v in state.get("acked", {}).items()}
            self.max_episode = {k: int(v) for k, v in state.get("max_episode", {}).items()}
            self.steps = int(state.get("steps", 0))
