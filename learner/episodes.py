"""Each actor's episodes as its records arrive: checks, staging for the store, drops.

:class:`learner.ingest.Ingest` hands every validated batch here, under its lock (this class
has none of its own): :meth:`ActorEpisodes.check` says whether the batch breaks an episode,
:meth:`ActorEpisodes.route` advances the actor's open episode over an accepted one, stages its
records and hands a finished episode to the episode store. What an actor's unsettled episodes
hold back from its ack is :meth:`ActorEpisodes.holds`; the store's commits release them
(:meth:`ActorEpisodes.settled`).

Episode checks (each rejection counted in ``Ingest.rejections`` under its reason and logged;
the whole batch is consumed and nothing stored changes):

- ``after_episode_end``: a record of an episode that already ended (after its ``is_last``
  record, or a non-final record after its terminating or truncating step);
- ``step_gap``: steps of an episode that do not follow one another;
- ``is_last_without_end``: a final-observation record whose previous step neither
  terminated nor truncated.

An episode that lost records to a rejected batch, whose start is missing, that an actor
left unfinished (a record of a newer episode arrives: an actor runs one episode at a time),
that runs past ``max_episode_records`` without ending, or that is the oldest unfinished one
when the records staged for the store by all actors together pass ``max_staged_bytes``
(``evicted``: memory stays bounded however many actor ids hold never-ending episodes) is
**dropped**: it never reaches the dataset (it is never half present), its records already in
the replay buffer stay sampleable transitions, its further records are discarded, and
``dropped`` counts it by reason. A dropped episode's records were never acknowledged (an open
episode holds its actor's ack); the ack then moves past them.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from data.core.transitions import TransitionBatch
from learner.episode_stats import Recent

log = logging.getLogger("tandem.learner.ingest")


@dataclass
class _StagedEpisode:
    """An actor's episode in progress: check state, and its records while a store needs them."""

    episode: int
    first_seq: int
    records: int = 0
    last_step: int = -1
    ended: bool = False          # its terminating / truncating step has arrived
    chunks: list = field(default_factory=list)  # (arrays, tasks, seqs) slices, when staging
    nbytes: int = 0              # bytes of its staged records (counted in staged_bytes)


@dataclass
class _Actor:
    open: _StagedEpisode | None = None
    pending: dict[int, int] = field(default_factory=dict)  # episode -> first seq, in the store
    ended: Recent = field(default_factory=Recent)
    dropped: Recent = field(default_factory=Recent)


class ActorEpisodes:
    """The open, pending (in the store, not yet durable), ended and dropped episodes of every
    actor. ``on_drop(actor, episode)`` is told of each dropped episode."""

    def __init__(self, *, store=None, max_episode_records: int = 100_000, max_staged_bytes: int = 1 << 30,
                 on_drop: Callable[[str, int], None] | None = None):
        self.store = store  # None: nothing is staged, an episode is settled once it is in memory
        self.max_episode_records = int(max_episode_records)
        #: bound on the records of unfinished episodes staged for the store, all actors together
        self.max_staged_bytes = int(max_staged_bytes)
        self.staged_bytes = 0
        self.on_drop = on_drop
        #: dropped episodes by reason
        self.dropped: Counter[str] = Counter()
        self.discarded_records = 0  # records of dropped episodes that arrived after the drop
        #: actor -> its open episode while it has staged records, oldest first (for eviction)
        self._staged: OrderedDict[str, _StagedEpisode] = OrderedDict()
        self._actors: dict[str, _Actor] = defaultdict(_Actor)

    def check(self, b: TransitionBatch) -> tuple[str, str] | None:
        """The first episode-level problem of a batch, simulated on a copy of the actor's
        open episode; None if the batch is acceptable."""
        st = self._actors[b.actor_id]
        a = b.arrays
        eps = a["episode"].tolist()
        steps = a["step"].tolist()
        last = a["is_last"].tolist()
        ends = (a["terminated"] | a["truncated"]).tolist()
        cur = None if st.open is None else [st.open.episode, st.open.last_step, st.open.ended]
        for i, ep in enumerate(eps):
            if ep in st.dropped:
                continue  # discarded in route, not a rejection
            where = f"seq {b.first_seq + i}, episode {ep}, step {steps[i]}"
            if ep in st.ended:
                return "after_episode_end", f"{where}: that episode already ended"
            if cur is not None and cur[0] == ep:
                if cur[2] and not last[i]:
                    return "after_episode_end", f"{where}: a step after the episode's last step"
                if steps[i] != cur[1] + 1:
                    return "step_gap", f"{where}: follows step {cur[1]}"
            else:
                cur = [ep, steps[i] - 1, False]  # a new episode (a missing start drops it)
            if last[i]:
                if not cur[2]:
                    return "is_last_without_end", f"{where}: the previous step did not end it"
                cur = None
                continue
            cur[1], cur[2] = steps[i], bool(ends[i])
        return None

    def route(self, b: TransitionBatch) -> np.ndarray:
        """Advance the actor's episode state over an accepted batch, stage records for the
        store, hand finished episodes to it; returns the mask of records to keep."""
        actor = b.actor_id
        st = self._actors[actor]
        a = b.arrays
        n = len(b)
        keep = np.ones(n, bool)
        eps = a["episode"].tolist()
        steps = a["step"].tolist()
        last = a["is_last"].tolist()
        ends = (a["terminated"] | a["truncated"]).tolist()
        staging = self.store is not None
        i = 0
        while i < n:
            ep = eps[i]
            j = i + 1
            while j < n and eps[j] == ep and not last[j - 1]:
                j += 1  # [i, j): a run of records of one episode
            if ep in st.dropped:
                keep[i:j] = False
                self.discarded_records += j - i
                i = j
                continue
            op = st.open
            if op is not None and op.episode != ep:
                self.drop_open(actor, "unfinished", f"the actor moved on to episode {ep} without finishing it")
                op = None
            if op is None:
                if steps[i] != 0:
                    st.dropped.add(ep)
                    self.dropped["start_missing"] += 1
                    log.warning("actor %s: episode %d arrives from step %d (its start is missing): "
                                "dropped", actor, ep, steps[i])
                    keep[i:j] = False
                    self.discarded_records += j - i
                    i = j
                    continue
                op = st.open = _StagedEpisode(ep, b.first_seq + i)
            op.records += j - i
            if op.records > self.max_episode_records and not last[j - 1]:
                # it would hold the actor's ack (and its staged records) forever
                self.drop_open(actor, "too_long", f"more than {self.max_episode_records} records "
                               "without an end")
                i = j
                continue
            if staging:
                chunk = {k: v[i:j] for k, v in a.items()}
                op.chunks.append((chunk, b.tasks[i:j],
                                  np.arange(b.first_seq + i, b.first_seq + j, dtype=np.int64)))
                nb = sum([v.nbytes for v in chunk.values()])
                op.nbytes += nb
                self.staged_bytes += nb
                self._staged.setdefault(actor, op)
            op.last_step = steps[j - 1]
            op.ended = bool(ends[j - 1])
            if last[j - 1]:
                st.open = None
                self._release(actor, op)
                st.ended.add(ep)
                if staging:
                    st.pending[ep] = op.first_seq
                    self.store.submit(_episode(actor, op))
            i = j
        return keep

    def _release(self, actor: str, op: _StagedEpisode) -> None:
        """``op`` no longer counts as staged (finished: handed to the store; or dropped)."""
        self.staged_bytes -= op.nbytes
        op.nbytes = 0
        if self._staged.get(actor) is op:
            del self._staged[actor]

    def evict(self) -> list[str]:
        """Over ``max_staged_bytes`` of unfinished episodes (all actors): drop the oldest open
        episodes until under it; returns their actors, whose acks may move on. Each is counted
        (``dropped["evicted"]``) and logged; its records were never acknowledged (an open
        episode holds its actor's ack), so they are never stored: nothing acknowledged is lost."""
        evicted = []
        while self.staged_bytes > self.max_staged_bytes and self._staged:
            actor = next(iter(self._staged))
            self.drop_open(actor, "evicted", f"{self.staged_bytes} bytes of unfinished episodes "
                           f"staged, over the limit of {self.max_staged_bytes} (all actors): the "
                           "oldest goes")
            evicted.append(actor)
        return evicted

    def drop_open(self, actor: str, reason: str, why: str) -> None:
        """Drop the actor's open episode, if it has one."""
        st = self._actors[actor]
        op = st.open
        if op is None:
            return
        st.open = None
        self._release(actor, op)
        op.chunks = []
        st.dropped.add(op.episode)
        self.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(actor, op.episode)
        log.warning("actor %s: episode %d dropped (%s): %s; it is not written to the dataset",
                    actor, op.episode, reason, why)

    def drop_touched(self, actor: str, first: int, last: int, ep_arr, what: str) -> None:
        """Records ``first..last`` went to a rejected batch: drop the open episode they touch
        (or, when their episode ids ``ep_arr`` are unreadable, any open episode of the actor)."""
        st = self._actors[actor]
        try:
            flat = np.asarray(ep_arr).reshape(-1)
            touched = set(flat.astype(np.int64).tolist()) if len(flat) == last - first + 1 else None
        except (TypeError, ValueError):
            touched = None
        if st.open is not None and (touched is None or st.open.episode in touched):
            self.drop_open(actor, "lost_records", f"records {first}..{last} went to {what}")

    def holds(self, actor: str, settled: set[tuple[str, int]] = frozenset()) -> int | None:
        """The first sequence number the actor's unsettled episodes hold back from its ack
        (pending in the store and not in ``settled``, or open while staging), or None."""
        st = self._actors[actor]
        lows = [fs for ep, fs in st.pending.items() if (actor, ep) not in settled]
        if st.open is not None and self.store is not None:
            lows.append(st.open.first_seq)
        return min(lows) if lows else None

    def settled(self, episodes) -> None:
        """The store made ``episodes`` durable, or refused them: they hold no ack any more."""
        for ep in episodes:
            self._actors[ep.actor_id].pending.pop(ep.episode, None)


def _episode(actor: str, op: _StagedEpisode):
    from data.store import Episode

    keys = op.chunks[0][0].keys()
    arrays = {k: np.concatenate([c[0][k] for c in op.chunks]) for k in keys}
    tasks = [t for c in op.chunks for t in c[1]]
    seqs = np.concatenate([c[2] for c in op.chunks])
    op.chunks = []
    return Episode(actor, op.episode, arrays, tasks, seqs)
