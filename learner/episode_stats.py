"""Finished-episode statistics per task (:class:`EpisodeStats`) and a bounded set of episode
ids (:class:`Recent`), for :class:`learner.ingest.Ingest`."""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

RECENT = 4096  # ended / dropped episode ids remembered per actor
MAX_TASKS = 1024  # tasks with statistics of their own; episodes of any further task are pooled
OTHER_TASKS = "(other tasks)"


@dataclass
class EpisodeStats:
    """Finished-episode returns and successes, per task (at most :data:`MAX_TASKS`; episodes of
    any further task are pooled under :data:`OTHER_TASKS`). Thread-safe: the socket thread adds
    episodes while the main loop and the status writer read (an unlocked read once met a
    deque mid-append under load and took the learner down)."""

    window: int = 100
    returns: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    successes: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    lengths: deque = field(default_factory=lambda: deque(maxlen=100))
    episodes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, task: str, ret: float, success: bool, length: int) -> None:
        with self._lock:
            if task not in self.returns and len(self.returns) >= MAX_TASKS:
                task = OTHER_TASKS  # bounded however many distinct instructions arrive
            for store, val in ((self.returns, ret), (self.successes, float(success))):
                dq = store[task]
                dq.append(val)
                while len(dq) > self.window:
                    dq.popleft()
            self.lengths.append(length)
            self.episodes += 1

    def summary(self) -> dict[str, float]:
        with self._lock:
            all_r = [r for dq in self.returns.values() for r in dq]
            all_s = [s for dq in self.successes.values() for s in dq]
            lengths, episodes = list(self.lengths), self.episodes
        if not all_r:
            return {"episodes": float(episodes)}
        return {
            "episodes": float(episodes),
            "return": float(np.mean(all_r)),
            "success": float(np.mean(all_s)),
            "length": float(np.mean(lengths)) if lengths else 0.0,
        }

    def per_task(self) -> dict[str, dict[str, float]]:
        with self._lock:
            rows = {t: (list(self.returns[t]), list(self.successes[t])) for t in sorted(self.returns)}
        return {t: {"episodes": len(r), "return": float(np.mean(r)), "success": float(np.mean(sv))}
                for t, (r, sv) in rows.items()}


class Recent:
    """A bounded set of episode ids."""

    def __init__(self, size: int = RECENT):
        self._d: OrderedDict[int, None] = OrderedDict()
        self.size = size

    def add(self, x: int) -> None:
        self._d[x] = None
        self._d.move_to_end(x)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def __contains__(self, x: int) -> bool:
        return x in self._d
