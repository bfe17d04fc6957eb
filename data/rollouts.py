"""On-policy data: whole episodes in arrival order (PPO, GRPO), and their action chunks.

:class:`RolloutQueue` is the on-policy :class:`agents.core.Sink` that ingest feeds. It
assembles each (actor, episode)'s records (every array of :mod:`data.core.schema`, policy
extras included, and the task strings) until the episode's ``is_last`` record arrives, then
appends the finished episode (:class:`RolloutEpisode`) to a FIFO. The learner takes whole
episodes from the front:

- :meth:`RolloutQueue.take` (PPO): up to ``n`` episodes, oldest first; an episode whose
  oldest policy version is below ``current_version - max_staleness`` is dropped and counted
  (``dropped_stale``);
- :meth:`RolloutQueue.take_groups` (GRPO): whole groups of episodes sharing a ``group_id``
  (the learner's jobs), stale episodes dropped the same way.

Memory is bounded: at most ``max_episodes`` finished episodes wait (the oldest is dropped and
counted, ``dropped_overflow``) and at most ``max_open`` unfinished ones are assembled (an
actor runs one episode at a time: a record of a newer episode ends the older one's assembly).
Persistence and acknowledgements are ingest's business: it is handed the episode store
separately (:class:`Rollouts` carries both, like :class:`data.sampler.Replay`).

Listeners (``on_finished``: called with each finished :class:`RolloutEpisode`;
``on_abandoned``: ``(actor_id, episode)``) run on the caller's thread, outside the queue's
lock; a GRPO job source uses them to learn which jobs are done.

Chunks
------
:func:`episode_chunks` cuts an episode into its policy decisions. A *chunk* starts at a record
with ``chunk_start`` True (or at step 0, if a human drove the first step) and runs to the
next start, or to the episode's end. For each chunk (numpy, one row per chunk):

====================  ==========================================================================
``obs index``         the chunk's first step (the observation the policy was asked about)
``next index``        the next chunk's first step, or the ``is_last`` record (final observation)
``action`` [H, A]     the executed actions of its steps, padded with the last one (H = horizon)
``reward``            the plain sum of its steps' rewards (a chunk is one decision)
``discount``          ``gamma ** (steps / H)``: ``gamma`` is the discount *per chunk* (as
                      :class:`agents.ppo.agent.PPOConfig` has it), so a full chunk is discounted by
                      ``gamma`` and an irregular one (a human's stretch) by its share of it
``terminated``        / ``truncated`` at the chunk's last step (only an episode's last can be)
``behaviour_log_prob`` ``extra.log_prob`` of the chunk-start record (0 without that extra)
``policy_version``    the chunk-start record's version
``policy_mask``       the chunk may enter the policy loss (see below)
``own_mask``          the policy's own chunk (started at its query, no human step), any length
====================  ==========================================================================

A chunk is masked out of the policy loss (``policy_mask`` False; it still gives rewards,
value targets and bootstrap values) when a human drove any of its steps, when it did not
start at a policy query, or when fewer than H of its actions ran (the episode ended inside
it, or the actor ran only part of each chunk): its recorded actions are then not the chunk
the policy sampled, so neither its log-probability nor its importance ratio means anything.
A policy with per-token log-probs of the chunk it sampled (the records' extras: OFT-discrete
tokens, a PI0 flow chain) can still learn from such a chunk's executed actions: ``own_mask``
and ``steps`` say which (:meth:`agents.ppo.agent.PPOAgent.update`, ``mask_unexecuted``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from data.core.schema import EXTRA_PREFIX
from data.with_store import WithStore

log = logging.getLogger("tandem.data.rollouts")

LOG_PROB = EXTRA_PREFIX + "log_prob"


@dataclass
class RolloutEpisode:
    """A finished episode: ``arrays`` (records in step order, the last one ``is_last``),
    ``tasks`` (one per record) and what the learner filters and reports on."""

    actor_id: str
    episode: int
    arrays: dict[str, np.ndarray]
    tasks: list[str]
    group_id: int
    min_version: int          # the oldest policy version that acted in it
    max_version: int
    success: bool             # the is_last record's
    ret: float                # undiscounted sum of rewards
    length: int               # env steps (is_last excluded)

    @property
    def key(self) -> tuple[str, int]:
        return self.actor_id, self.episode

    @property
    def task(self) -> str:
        return self.tasks[0] if self.tasks else ""

    @classmethod
    def from_arrays(cls, actor_id: str, episode: int, arrays: dict[str, np.ndarray],
                    tasks: list[str]) -> "RolloutEpisode":
        steps = ~arrays["is_last"].astype(bool)
        versions = arrays["policy_version"][steps] if steps.any() else arrays["policy_version"]
        groups = arrays["group_id"]
        return cls(actor_id, int(episode), arrays, list(tasks), int(groups[0]),
                   int(versions.min()), int(versions.max()), bool(arrays["success"][-1]),
                   float(arrays["reward"][steps].sum()), int(steps.sum()))


class RolloutQueue:
    """Thread-safe FIFO of finished episodes; ingest's sink for on-policy algorithms."""

    def __init__(self, *, max_episodes: int = 1024, max_staleness: int = 0, max_open: int = 1024):
        if max_episodes < 1 or max_open < 1 or max_staleness < 0:
            raise ValueError("max_episodes and max_open must be >= 1, max_staleness >= 0")
        self.max_episodes = int(max_episodes)
        self.max_staleness = int(max_staleness)
        self.max_open = int(max_open)
        self.on_finished: list[Callable[[RolloutEpisode], None]] = []
        self.on_abandoned: list[Callable[[str, int], None]] = []
        self.counters: Counter[str] = Counter()
        self.total_added = 0      # records added
        self._open: OrderedDict[tuple[str, int], list] = OrderedDict()  # key -> [(arrays, tasks)]
        self._queue: deque[RolloutEpisode] = deque()
        self._closed = False
        self._lock = threading.Lock()

    # ---- the Sink side (ingest's thread) ------------------------------------------------------

    def add(self, batch) -> int:
        """Take a validated :class:`data.core.transitions.TransitionBatch` of one actor."""
        a, n = batch.arrays, len(batch)
        if n == 0:
            return 0
        eps, last = a["episode"], a["is_last"].astype(bool)
        finished: list[RolloutEpisode] = []
        abandoned: list[tuple[str, int]] = []
        with self._lock:
            if self._closed:
                return 0
            self.total_added += n
            i = 0
            while i < n:
                ep = int(eps[i])
                j = i + 1
                while j < n and int(eps[j]) == ep and not last[j - 1]:
                    j += 1
                key = (batch.actor_id, ep)
                for other in [k for k in self._open if k[0] == batch.actor_id and k != key]:
                    del self._open[other]  # the actor moved on: that one will never finish
                    self.counters["abandoned"] += 1
                    abandoned.append(other)
                parts = self._open.setdefault(key, [])
                parts.append(({k: v[i:j] for k, v in a.items()}, batch.tasks[i:j]))
                if last[j - 1]:
                    del self._open[key]
                    finished.append(self._finish(key, parts))
                while len(self._open) > self.max_open:
                    old, _ = self._open.popitem(last=False)
                    self.counters["dropped_open"] += 1
                    abandoned.append(old)
                i = j
        for key in abandoned:
            self._notify(self.on_abandoned, *key)
        for ep in finished:
            self._notify(self.on_finished, ep)
        return n

    def _finish(self, key: tuple[str, int], parts: list) -> RolloutEpisode:
        arrays = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        tasks = [t for p in parts for t in p[1]]
        ep = RolloutEpisode.from_arrays(key[0], key[1], arrays, tasks)
        self._queue.append(ep)
        self.counters["episodes"] += 1
        while len(self._queue) > self.max_episodes:
            self._queue.popleft()
            self.counters["dropped_overflow"] += 1
        return ep

    def abandon(self, actor_id: str, episode: int) -> None:
        """Ingest dropped the actor's unfinished episode: forget its records."""
        with self._lock:
            had = self._open.pop((str(actor_id), int(episode)), None) is not None
            if had:
                self.counters["abandoned"] += 1
        if had:
            self._notify(self.on_abandoned, str(actor_id), int(episode))

    def _notify(self, listeners: list, *args) -> None:
        for fn in listeners:
            try:
                fn(*args)
            except Exception:  # a broken listener must not stop ingest
                log.exception("rollout listener %r failed", fn)

    # ---- the learner side -------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def ready(self, n: int = 1) -> bool:
        return len(self) >= n

    def is_stale(self, ep: RolloutEpisode, current_version: int) -> bool:
        return ep.min_version < int(current_version) - self.max_staleness

    def take(self, n: int, *, current_version: int) -> list[RolloutEpisode]:
        """Pop up to ``n`` fresh episodes, oldest first (stale ones are dropped on the way)."""
        out: list[RolloutEpisode] = []
        with self._lock:
            while self._queue and len(out) < n:
                ep = self._queue.popleft()
                if self.is_stale(ep, current_version):
                    self.counters["dropped_stale"] += 1
                else:
                    out.append(ep)
            self.counters["taken"] += len(out)
        return out

    def group_counts(self, *, current_version: int | None = None) -> dict[int, int]:
        """group id -> queued (fresh, when ``current_version`` is given) episodes; -1 excluded."""
        counts: Counter[int] = Counter()
        with self._lock:
            for ep in self._queue:
                if ep.group_id >= 0 and (current_version is None
                                         or not self.is_stale(ep, current_version)):
                    counts[ep.group_id] += 1
        return dict(counts)

    def take_groups(self, group_size: int, *, current_version: int,
                    groups: Iterable[int] | None = None, min_size: int | None = None,
                    max_groups: int = 0) -> list[list[RolloutEpisode]]:
        """Pop whole groups: those (among ``groups``, if given) holding at least ``min_size``
        (default ``group_size``) fresh episodes, in order of their first episode's arrival,
        at most ``max_groups`` (0: all). Each comes back as a list of at most ``group_size``
        episodes; surplus episodes of a taken group (a reissued job finished twice) are
        dropped (``dropped_surplus``), so are its stale ones (``dropped_stale``)."""
        need = int(group_size if min_size is None else min_size)
        wanted = None if groups is None else set(int(g) for g in groups)
        with self._lock:
            fresh: OrderedDict[int, list[RolloutEpisode]] = OrderedDict()
            for ep in self._queue:
                if ep.group_id >= 0 and (wanted is None or ep.group_id in wanted) \
                        and not self.is_stale(ep, current_version):
                    fresh.setdefault(ep.group_id, []).append(ep)
            chosen = [g for g, eps in fresh.items() if len(eps) >= need]
            if max_groups:
                chosen = chosen[:max_groups]
            take = set(chosen)
            keep: deque[RolloutEpisode] = deque()
            for ep in self._queue:
                if ep.group_id in take:
                    if self.is_stale(ep, current_version):
                        self.counters["dropped_stale"] += 1
                else:
                    keep.append(ep)
            self._queue = keep
            out = []
            for g in chosen:
                eps = fresh[g]
                self.counters["dropped_surplus"] += max(0, len(eps) - group_size)
                out.append(eps[:group_size])
                self.counters["taken"] += len(out[-1])
        return out

    def prune(self, keep: Callable[[RolloutEpisode], bool], reason: str) -> int:
        """Drop queued episodes for which ``keep`` is False, counted under ``dropped_<reason>``
        (GRPO: episodes run without a job, or for a group no round waits for)."""
        with self._lock:
            before = len(self._queue)
            self._queue = deque(ep for ep in self._queue if keep(ep))
            n = before - len(self._queue)
            self.counters["dropped_" + reason] += n
        return n

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"queued_episodes": len(self._queue), "open_episodes": len(self._open),
                    "records": self.total_added, **dict(self.counters)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._open.clear()


@dataclass
class Rollouts(WithStore):
    """An on-policy algorithm's data: ``queue`` (ingest's sink) and the episode ``store``
    (or None), which ingest writes every episode to."""

    queue: RolloutQueue
    store: Any = None

    @property
    def sink(self) -> RolloutQueue:
        return self.queue

    def status(self) -> dict:
        return self._status_with_store(self.queue.status())

    def close(self, timeout: float = 30.0) -> None:
        self._close_store(timeout)
        self.queue.close()


def build_rollouts(cfg, spec, *, run_dir, train: bool = True, max_episodes: int = 1024,
                   max_staleness: int = 0) -> Rollouts:
    """The rollout queue and (in training, with ``buffer.persist``) the episode store from the
    ``buffer:`` config section; the store is not refilled (old episodes are off-policy)."""
    from data.sampler import build_store

    store = build_store(cfg, spec, run_dir=run_dir, train=train)
    return Rollouts(RolloutQueue(max_episodes=max_episodes, max_staleness=max_staleness), store)


# ---- chunks --------------------------------------------------------------------------------

@dataclass
class EpisodeChunks:
    """One episode's chunks (see the module docstring); K chunks, H = horizon."""

    obs_index: np.ndarray          # int64 [K]
    next_index: np.ndarray         # int64 [K]
    action: np.ndarray             # float32 [K, H, A]
    reward: np.ndarray             # float32 [K]
    discount: np.ndarray           # float32 [K]
    steps: np.ndarray              # int64 [K]
    terminated: np.ndarray         # bool [K]
    truncated: np.ndarray          # bool [K]
    behaviour_log_prob: np.ndarray  # float32 [K]
    policy_version: np.ndarray     # int64 [K]
    policy_mask: np.ndarray        # bool [K]
    intervened: np.ndarray         # bool [K]: a human drove one of its steps
    own_mask: np.ndarray           # bool [K]: started at a policy query, no human step (any length)

    def __len__(self) -> int:
        return int(self.obs_index.shape[0])


def episode_chunks(ep: RolloutEpisode, horizon: int, gamma: float = 1.0) -> EpisodeChunks:
    """Cut ``ep`` into its chunks (module docstring); ``horizon`` is the policy's chunk size,
    ``gamma`` the discount per chunk."""
    a = ep.arrays
    is_last = a["is_last"].astype(bool)
    T = int(np.flatnonzero(is_last)[0]) if is_last.any() else len(is_last)
    starts_mask = a["chunk_start"][:T].astype(bool).copy()
    if T:
        starts_mask[0] = True
    starts = np.flatnonzero(starts_mask)
    ends = np.append(starts[1:], T)
    H, K = int(horizon), len(starts)
    act = a["action"][:T].astype(np.float32)
    rew = a["reward"][:T].astype(np.float64)
    human = a["intervened"][:T].astype(bool)
    lp = a[LOG_PROB][:T].astype(np.float32) if LOG_PROB in a else np.zeros(T, np.float32)
    out = EpisodeChunks(
        obs_index=starts.astype(np.int64), next_index=ends.astype(np.int64),
        action=np.zeros((K, H) + act.shape[1:], np.float32), reward=np.zeros(K, np.float32),
        discount=np.zeros(K, np.float32), steps=(ends - starts).astype(np.int64),
        terminated=a["terminated"][ends - 1].astype(bool) if K else np.zeros(0, bool),
        truncated=a["truncated"][ends - 1].astype(bool) if K else np.zeros(0, bool),
        behaviour_log_prob=lp[starts], policy_version=a["policy_version"][starts].astype(np.int64),
        policy_mask=np.zeros(K, bool), intervened=np.zeros(K, bool), own_mask=np.zeros(K, bool))
    for k, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        n = e - s
        m = min(n, H)
        out.action[k, :m] = act[s:s + m]
        out.action[k, m:] = act[s + m - 1]
        out.reward[k] = float(rew[s:e].sum())
        out.discount[k] = gamma ** (n / H)
        out.intervened[k] = bool(human[s:e].any())
        out.own_mask[k] = bool(a["chunk_start"][s]) and not out.intervened[k]
        out.policy_mask[k] = out.own_mask[k] and n == H
    return out
