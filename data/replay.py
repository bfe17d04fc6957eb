"""In-memory replay ring: uint8 images, next observation by index, thread-safe.

One slot holds one *record* of :mod:`data.core.schema` (``obs_t``, the action taken in it and the
reward / termination / truncation that followed; or an episode's final ``is_last``
observation). A record's next observation is the record that follows it in the same
(actor, episode), reached through ``next_idx``: nothing is copied, every observation is
stored once. A record is a sampleable *transition* once its successor has arrived and it is
not itself an ``is_last`` record; ``len(buffer)`` counts those.

Storage (``capacity`` slots, allocated up front)::

    observation.state             float32 [C, S]
    observation.images.<cam>      uint8   [C, H, W, 3]   (image_codec="raw")
                                  or one lossless blob per slot (image_codec="lz4"/"zlib",
                                  see :mod:`data.image_store`)
    action                        float32 [C, A]
    reward                        float32 [C]
    terminated, truncated         bool    [C]   (kept apart everywhere)
    intervened, is_last, success  bool    [C]
    chunk_start                   bool    [C]
    policy_version, step          int32   [C]   (int64 in sampled batches)
    chunk_index                   int32   [C]   (int64 in sampled batches)
    episode, group_id             int64   [C]
    extra.<name>                  <dtype> [C, *shape]  one per ``spec.extras`` entry, its
                                  declared dtype (zeros for records that lack it: demos,
                                  data written before the policy declared it)
    task id, next_idx             int32   [C]   (tasks kept once in a table)
    valid, episode_success        bool    [C]

The ring overwrites the oldest slot first. A successor is always newer than its predecessor,
so a sampleable record's successor is never overwritten before it. ``episode_success`` is
set on every record of an episode when its ``is_last`` record (whose ``success`` is the
episode's outcome) arrives; the success-filtered view of :mod:`data.sampler` uses it.

``sample(n)`` returns torch tensors: the record keys with :data:`data.core.schema.STEP_ARRAYS`
dtypes, ``extra.<name>`` [B, *shape] (their declared dtypes), the observation keys,
``"next." + <obs key>`` and ``"task"`` (a list of str). Images stay uint8 ``[B, H, W, 3]``
(the policy converts them on its device). When the buffer's device is CUDA, the batch is
gathered into pinned host memory and copied with ``non_blocking=True``.

``sample(n, horizon=H)`` with H > 1 returns action-chunk windows (:mod:`data.replay_windows`
says which windows are available and why none is stale): ``action`` [B, H, A] (padded past
the episode's end with the last real action), ``reward`` [B, H] (0 past the end),
``step_mask`` [B, H] bool, ``n_steps`` [B] int64 (k real steps), ``terminated`` /
``truncated`` [B] (at one of the real steps), ``next.<obs key>`` after the k-th step, and
every other key from the window's first step.

``add`` and ``sample`` take one lock; the gather runs under it (raw images), or only the
blob look-up does and encoding / decoding run outside it (lz4, zlib).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.image_store import IMAGE_CODECS, make_image_store, resolve_codec
from data.replay_windows import draw, follow
from data.core.transitions import TransitionBatch
from data.core.spec import EnvSpec

__all__ = ["IMAGE_CODECS", "ReplayBuffer", "SlotFilter", "resolve_codec"]

# A filter for :meth:`ReplayBuffer.sample`: called under the buffer's lock with the buffer,
# returns a bool mask [capacity] of the slots it admits (ANDed with "is a transition").
SlotFilter = Callable[["ReplayBuffer"], np.ndarray]

_FLAGS = ("terminated", "truncated", "intervened", "is_last", "success", "chunk_start")
# record columns besides action, flags and extras: name -> storage dtype (batches: int64)
_INTS = {"policy_version": np.int32, "step": np.int32, "chunk_index": np.int32,
         "episode": np.int64, "group_id": np.int64}


@dataclass
class _OpenChain:
    """The newest stored record of an (actor, episode) still waiting for its successor."""

    slot: int                 # slot of the episode's newest record
    gidx: int                 # global index (total_added at the time) of that record
    gidxs: list[int] = field(default_factory=list)  # every record's global index so far


class ReplayBuffer:
    """Thread-safe ring buffer of transition records. ``add`` and ``sample`` may run
    concurrently (ingest thread vs trainer thread)."""

    def __init__(self, capacity: int, spec: EnvSpec, *, seed: int = 0, device: str = "cpu",
                 image_codec: str = "raw", decode_threads: int = 2, pin_memory: bool | None = None):
        if capacity < 2:
            raise ValueError(f"replay capacity must be >= 2, got {capacity}")
        self.capacity = c = int(capacity)
        self.spec = spec
        self.device = torch.device(device)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.image_codec = image_codec = resolve_codec(image_codec)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.image_keys = list(spec.image_keys)
        self._state = np.zeros((c, spec.state_dim), np.float32)
        self._images: dict[str, Any] = {
            k: make_image_store(image_codec, c, tuple(spec.cameras[k[len(OBS_IMAGE_PREFIX):]]),
                                threads=decode_threads)
            for k in self.image_keys}
        # every per-record column a batch carries, stored [C, *shape]
        self._cols: dict[str, np.ndarray] = {
            "action": np.zeros((c, spec.action_dim), np.float32),
            "reward": np.zeros(c, np.float32),
            **{k: np.zeros(c, bool) for k in _FLAGS},
            **{k: np.zeros(c, dt) for k, dt in _INTS.items()},
        }
        for k, name in zip(spec.extra_keys, sorted(spec.extras)):
            dt, shape = spec.extras[name]
            self._cols[k] = np.zeros((c, *shape), np.dtype(dt))
        self._flags = {k: self._cols[k] for k in _FLAGS}
        self._task_id = np.zeros(c, np.int32)
        self._next_idx = np.full(c, -1, np.int32)
        self._valid = np.zeros(c, bool)
        self._ep_success = np.zeros(c, bool)
        self._tasks: list[str] = []
        self._task_ids: dict[str, int] = {}
        self._pos = 0
        self._size = 0
        self._open: dict[tuple[str, int], _OpenChain] = {}
        self._gidx = 0          # records ever written (global index of the next record)
        self.total_added = 0    # records added by ingest (``add``), restored ones excluded
        self.restored = 0       # records reloaded from disk (``add(..., restored=True)``)
        self._n_valid = 0

    # ---- sizes -----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of sampleable transitions."""
        return self._n_valid

    def state_action(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the state [N, S] and action [N, A] of every sampleable transition (for
        normalisation statistics)."""
        with self._lock:
            return self._state[self._valid].copy(), self._cols["action"][self._valid].copy()

    @property
    def num_records(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes held by the ring's storage (arrays, extras and image blobs; the small task
        table and the open-episode bookkeeping are not counted)."""
        arrays = [self._state, self._task_id, self._next_idx, self._valid, self._ep_success,
                  *self._cols.values()]
        return sum(a.nbytes for a in arrays) + sum(s.nbytes for s in self._images.values())

    # ---- adding ------------------------------------------------------------------------------

    def _task(self, t: str) -> int:
        i = self._task_ids.get(t)
        if i is None:
            i = self._task_ids[t] = len(self._tasks)
            self._tasks.append(t)
        return i

    def add(self, batch: TransitionBatch, *, restored: bool = False) -> int:
        """Store a validated batch (records of one actor, in sequence order); returns the
        number of records stored. Batches longer than the capacity keep their newest
        ``capacity`` records. ``restored``: records reloaded from disk (counted apart).
        Extras the batch lacks are stored as zeros; arrays the spec does not name are
        ignored."""
        n = len(batch)
        start = 0
        while start < n:  # chunks never wrap onto themselves
            end = min(n, start + self.capacity)
            self._add_chunk(batch, start, end)
            start = end
        with self._lock:
            if restored:
                self.restored += n
            else:
                self.total_added += n
        return n

    def _add_chunk(self, batch: TransitionBatch, i0: int, i1: int) -> None:
        a = batch.arrays
        n = i1 - i0
        sl = slice(i0, i1)
        encoded = {k: [store.encode(img) for img in a[k][sl]]
                   for k, store in self._images.items() if store.lazy}
        with self._lock:
            p = self._pos
            if p + n <= self.capacity:
                slots: Any = slice(p, p + n)
                slot_list = range(p, p + n)
            else:
                slots = (p + np.arange(n)) % self.capacity
                slot_list = slots.tolist()
            # the overwritten records disappear
            self._n_valid -= int(self._valid[slots].sum())
            self._valid[slots] = False
            self._next_idx[slots] = -1
            self._ep_success[slots] = False
            self._state[slots] = a[OBS_STATE][sl]
            for k, store in self._images.items():
                store.put(slots, encoded[k] if store.lazy else a[k][sl])
            for k, col in self._cols.items():
                src = a.get(k)
                col[slots] = 0 if src is None else src[sl]
            self._task_id[slots] = [self._task(t) for t in batch.tasks[i0:i1]]
            self._link(batch.actor_id, a["episode"][sl].tolist(), a["is_last"][sl].tolist(),
                       slot_list, n)
            self._pos = (p + n) % self.capacity
            self._size = min(self._size + n, self.capacity)
            self._gidx += n

    def _link(self, actor: str, episodes: list, last: list, slot_list, n: int) -> None:
        """Point each open chain at its new record (under the lock)."""
        oldest_alive = self._gidx + n - self.capacity  # global index
        for i, j in enumerate(slot_list):
            g = self._gidx + i
            key = (actor, episodes[i])
            op = self._open.get(key)
            if op is not None and op.gidx >= oldest_alive:
                self._next_idx[op.slot] = j
                if not self._valid[op.slot]:
                    self._valid[op.slot] = True
                    self._n_valid += 1
            if last[i]:
                self._open.pop(key, None)
                if self._flags["success"][j] and op is not None:
                    alive = [x % self.capacity for x in op.gidxs if x >= oldest_alive]
                    self._ep_success[alive] = True
                    self._ep_success[j] = True
            else:
                if op is None:
                    op = self._open[key] = _OpenChain(j, g)
                op.slot, op.gidx = j, g
                op.gidxs.append(g)

    def abandon(self, actor_id: str, episode: int) -> None:
        """Forget an unfinished episode (its stored transitions stay; its newest record never
        gets a successor)."""
        with self._lock:
            self._open.pop((actor_id, int(episode)), None)

    @property
    def open_episodes(self) -> int:
        return len(self._open)

    # ---- sampling ----------------------------------------------------------------------------

    def _walk(self, horizon: int):
        f = self._flags
        return partial(follow, horizon=horizon, next_idx=self._next_idx, valid=self._valid,
                       is_last=f["is_last"], terminated=f["terminated"],
                       truncated=f["truncated"])

    def count(self, where: SlotFilter | None = None, *, horizon: int = 1) -> int:
        """Number of sampleable transitions admitted by ``where`` (``horizon`` > 1: of
        available windows, see :mod:`data.replay_windows`; that walks every start)."""
        if where is None and horizon == 1:
            return len(self)
        with self._lock:
            mask = self._valid if where is None else (self._valid & where(self))
            if horizon == 1:
                return int(mask.sum())
            return int(self._walk(horizon)(np.flatnonzero(mask)).ok.sum())

    def sample(self, n: int, *, where: SlotFilter | None = None,
               horizon: int = 1) -> dict[str, Any]:
        """Uniformly sample ``n`` transitions (with replacement) as torch tensors on the
        buffer's device; ``next.<obs key>`` are the successors' observations. ``where``
        restricts the pool (see :data:`SlotFilter`; it admits a window by its first step).
        ``horizon`` > 1: windows of that many steps (module docstring), uniform over the
        available ones. Raises ValueError when the pool is empty."""
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        out: dict[str, torch.Tensor] = {}
        pin = self.pin_memory

        def alloc(key: str, shape: tuple, dtype: torch.dtype) -> np.ndarray:
            t = out[key] = torch.empty(shape, dtype=dtype, pin_memory=pin)
            return t.numpy()

        lazy: list[tuple[Any, list, np.ndarray]] = []
        with self._lock:
            mask = self._valid if where is None else (self._valid & where(self))
            pool = np.flatnonzero(mask)
            if len(pool) == 0:
                raise ValueError("replay buffer has no transition to sample"
                                 + ("" if where is None else " that passes the filter"))
            if horizon == 1:
                idx = pool[self._rng.integers(0, len(pool), size=n)]
                nxt = self._next_idx[idx].astype(np.int64)
            else:
                w = draw(self._rng, pool, n, horizon, self._walk(horizon))
                idx, nxt = w.slots[:, 0], w.final
            for src, pre in ((idx, ""), (nxt, "next.")):
                np.take(self._state, src, axis=0,
                        out=alloc(pre + OBS_STATE, (n, self.spec.state_dim), torch.float32))
                for k, store in self._images.items():
                    buf = alloc(pre + k, (n, *store.shape), torch.uint8)
                    if store.lazy:
                        lazy.append((store, store.refs(src), buf))
                    else:
                        store.get(src, buf)
            for k, col in self._cols.items():
                src = idx
                if horizon > 1 and k in ("action", "reward"):
                    src = w.slots  # [n, H]: padded with the last real step
                elif horizon > 1 and k in ("terminated", "truncated"):
                    src = w.slots[:, -1]  # the last real step (a window stops at either)
                buf = alloc(k, (*src.shape, *col.shape[1:]),
                            torch.int64 if k in _INTS else torch.from_numpy(col[:0]).dtype)
                if buf.dtype == col.dtype:
                    np.take(col, src, axis=0, out=buf)
                else:
                    buf[...] = col[src]
            if horizon > 1:
                out["reward"].numpy()[~w.mask] = 0.0
                alloc("step_mask", (n, horizon), torch.bool)[:] = w.mask
                alloc("n_steps", (n,), torch.int64)[:] = w.mask.sum(1)
            tasks = [self._tasks[t] for t in self._task_id[idx].tolist()]
        for store, refs, buf in lazy:
            store.decode(refs, buf)
        batch: dict[str, Any] = {}
        for k, t in out.items():
            # non_blocking from pinned memory: the caching host allocator keeps the block
            # until the copy is done (``t`` is the allocator's own tensor)
            batch[k] = t.to(self.device, non_blocking=pin) if self.device.type != "cpu" else t
        batch["task"] = tasks
        return batch

    # ---- per-slot views for filters (read under the lock by SlotFilter callables) ----------

    @property
    def policy_versions(self) -> np.ndarray:
        return self._cols["policy_version"]

    @property
    def intervened(self) -> np.ndarray:
        return self._flags["intervened"]

    @property
    def episode_success(self) -> np.ndarray:
        return self._ep_success

    def close(self) -> None:
        for s in self._images.values():
            s.close()
