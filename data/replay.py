"""Minimal in-memory replay buffer (the vertical slice's; the LeRobot-backed one replaces it
behind the same interface).

Records are stored once in preallocated arrays (images uint8). A record's next observation
is reached through ``next_idx`` (the index of the following record of the same actor and
episode), never copied. A record is sampleable once its successor has arrived and it is
not itself an ``is_last`` record. The ring overwrites oldest first, and a successor is
always newer than its predecessor, so a sampleable record's successor is never gone.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from data.schema import OBS_IMAGE_PREFIX, OBS_STATE, STEP_ARRAYS
from data.transitions import TransitionBatch
from envs.spec import EnvSpec


class ReplayBuffer:
    """Thread-safe ring buffer of transitions. ``add`` and ``sample`` may run concurrently."""

    def __init__(self, capacity: int, spec: EnvSpec, *, seed: int = 0, device: str = "cpu"):
        if capacity < 2:
            raise ValueError(f"replay capacity must be >= 2, got {capacity}")
        self.capacity = int(capacity)
        self.spec = spec
        self.device = torch.device(device)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._obs_keys = [OBS_STATE] + spec.image_keys
        shapes = {OBS_STATE: ((spec.state_dim,), np.float32), "action": ((spec.action_dim,), np.float32)}
        for k in spec.image_keys:
            shapes[k] = (spec.cameras[k[len(OBS_IMAGE_PREFIX):]], np.uint8)
        for k, dt in STEP_ARRAYS.items():
            shapes.setdefault(k, ((), np.dtype(dt)))
        self._data = {k: np.zeros((capacity, *shape), dtype=dt) for k, (shape, dt) in shapes.items()}
        self._tasks: list[str] = [""] * capacity
        self._next_idx = np.full(capacity, -1, dtype=np.int64)
        self._valid = np.zeros(capacity, dtype=bool)
        self._pos = 0
        self._size = 0
        self._open: dict[tuple[str, int], int] = {}  # (actor, episode) -> index of last record
        self.total_added = 0

    def __len__(self) -> int:
        return int(self._valid.sum())

    @property
    def num_records(self) -> int:
        return self._size

    def add(self, batch: TransitionBatch) -> int:
        """Store a validated batch; returns the number of records stored."""
        a = batch.arrays
        with self._lock:
            for i in range(len(batch)):
                j = self._pos
                self._valid[j] = False
                self._next_idx[j] = -1
                for k, store in self._data.items():
                    store[j] = a[k][i]
                self._tasks[j] = batch.tasks[i]
                key = (batch.actor_id, int(a["episode"][i]))
                prev = self._open.get(key)
                if prev is not None and self._data["episode"][prev] == key[1]:
                    self._next_idx[prev] = j
                    self._valid[prev] = not self._data["is_last"][prev]
                if a["is_last"][i]:
                    self._open.pop(key, None)
                else:
                    self._open[key] = j
                self._pos = (j + 1) % self.capacity
                self._size = min(self._size + 1, self.capacity)
            self.total_added += len(batch)
        return len(batch)

    def sample(self, n: int) -> dict[str, Any]:
        """Uniformly sample ``n`` transitions as torch tensors (``next.*`` by index)."""
        with self._lock:
            idx_pool = np.flatnonzero(self._valid)
            if len(idx_pool) == 0:
                raise ValueError("replay buffer has no complete transition to sample")
            idx = idx_pool[self._rng.integers(0, len(idx_pool), size=n)]
            nxt = self._next_idx[idx]
            out = {k: self._data[k][idx] for k in self._data}
            for k in self._obs_keys:
                out["next." + k] = self._data[k][nxt]
            tasks = [self._tasks[i] for i in idx]
        batch: dict[str, Any] = {k: torch.from_numpy(v).to(self.device) for k, v in out.items()}
        batch["task"] = tasks
        return batch
