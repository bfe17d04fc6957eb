"""Ingest: per-actor sequence numbers, episode checks, storage, durable acks, statistics.

Each actor numbers its records 0, 1, 2, ... . ``received`` is the highest sequence number
taken in (stored, or consumed as rejected) for an actor; a batch that overlaps it is trimmed
(duplicates after a resend are dropped), one that leaves a gap is refused so that the actor
resends from its ack.

Durable, and what is acknowledged
---------------------------------
A record is *settled* when it can never be needed again from the actor:

- it belongs to an episode that is **durable**: the whole episode (through its ``is_last``
  record) is in the LeRobot dataset, in a commit of :class:`data.store.EpisodeStore`
  (files closed and fsynced, commit record atomically replaced);
- or it was **rejected** (bad input, counted and logged) or belongs to an episode that was
  **dropped** (counted and logged), so it will never be stored.

``acked`` for an actor is the highest sequence number S such that every record <= S is
settled. The learner acknowledges exactly that on the wire, so an actor's spool keeps an
in-progress episode (and a finished one not yet committed) until it is durable, and resends
it to a restarted learner. With no episode store (``store=None``: evaluation, or persistence
off) records are settled once they are in memory, as in the vertical slice.

When a commit makes episodes durable, the store calls back (from its writer thread) and
``on_ack(actor_id, acked_seq)`` is called for every actor whose ack advanced, so that the
learner can push the ack without waiting for the actor's next batch. The commit record also
holds the acks, so a restarted learner starts from them (:meth:`Ingest.load_state_dict`
never lowers them below what the dataset holds).

Episode checks (each rejection counted in ``rejections`` under its reason and logged; the
whole batch is consumed and nothing stored changes):

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
``dropped_episodes`` counts it by reason. A dropped episode's records were never acknowledged
(an open episode holds its actor's ack); the ack then moves past them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from data.core.transitions import TransitionBatch, TransitionError
from learner.episode_stats import EpisodeStats, Recent

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
    nbytes: int = 0              # bytes of its staged records (counted in Ingest.staged_bytes)


@dataclass
class _Actor:
    open: _StagedEpisode | None = None
    pending: dict[int, int] = field(default_factory=dict)  # episode -> first seq, in the store
    ended: Recent = field(default_factory=Recent)
    dropped: Recent = field(default_factory=Recent)


class Ingest:
    """Thread-safe front of the algorithm's sink (:class:`agents.core.Sink`: the replay ring
    for SAC) and the episode store; called from the service thread (``add``, ``skip``,
    ``resync``) and the store's writer thread (callbacks)."""

    def __init__(self, sink, *, store=None, store_transitions: bool = True,
                 stats_window: int = 100, on_ack: Callable[[str, int], None] | None = None,
                 max_episode_records: int = 100_000, max_staged_bytes: int = 1 << 30):
        self.sink = sink
        self.max_episode_records = int(max_episode_records)
        #: bound on the records of unfinished episodes staged for the store, all actors together
        self.max_staged_bytes = int(max_staged_bytes)
        self.staged_bytes = 0
        #: actor -> its open episode while it has staged records, oldest first (for eviction)
        self._staged: OrderedDict[str, _StagedEpisode] = OrderedDict()
        self.store_transitions = store_transitions
        self.store = store if store_transitions else None
        self.on_ack = on_ack
        self.stats = EpisodeStats(window=stats_window)
        self.received: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        self._acked_here: set[str] = set()  # actors this process has acknowledged records of
        self.max_episode: dict[str, int] = {}
        self.rejections: Counter[str] = Counter()
        self.dropped_episodes: Counter[str] = Counter()
        self.discarded_records = 0
        self.steps = 0  # env steps stored (is_last records excluded)
        self._running: dict[tuple[str, int], list] = {}  # (actor, episode) -> [return, success, len]
        self._actors: dict[str, _Actor] = defaultdict(_Actor)
        self._lock = threading.Lock()
        #: optional observer of new records, ``(batch, keep mask)``: the operator's view
        #: (learner/actor_stats.py) and evaluation videos; called under the lock
        self.on_records: Callable[[TransitionBatch, np.ndarray], None] | None = None
        if self.store is not None:
            self.store.on_durable = self._on_durable
            self.store.ack_preview = self._ack_preview
            self.received = dict(self.store.acked)
            self.acked = dict(self.store.acked)
            self.max_episode = dict(self.store.max_episode)

    # ---- connection-time ---------------------------------------------------------------------

    @property
    def durable_acks(self) -> bool:
        """``acked`` survives a restart (the store's commit record holds it), so a resend
        position beyond ``acked + 1`` was never acknowledged. (One gap: an ack that advanced
        over rejected or dropped records only reaches the record with the actor's next
        commit; a SIGKILL in between makes that actor's reconnect a ``bad_resend``.)"""
        return self.store is not None

    def knows_acks(self, actor_id: str) -> bool:
        """``acked`` is exactly what this actor was told: with a store, or once this process
        acknowledged its records (a restored checkpoint's position may lag an earlier process)."""
        with self._lock:
            return self.store is not None or actor_id in self._acked_here

    def knows_actor(self, actor_id: str) -> bool:
        """Whether this learner keeps sequence state for ``actor_id``."""
        with self._lock:
            return actor_id in self.received or actor_id in self.acked

    def actor_count(self) -> int:
        """Actor ids this learner keeps sequence state for (bounded by the service's hello
        check, ``max_actor_ids``)."""
        with self._lock:
            return len(self.received.keys() | self.acked.keys())

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
                self._drop_open(actor_id, "records_lost",
                                f"records {have + 1}..{resend_from - 1} are gone")
                self.received[actor_id] = resend_from - 1
                self._settle(actor_id)

    # ---- records ---------------------------------------------------------------------------

    def count_rejection(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason.split(":")[0]] += 1

    def skip(self, batch: TransitionBatch) -> int:
        """Consume a rejected batch's sequence numbers without storing it; returns the ack.
        An unfinished episode of the actor that this batch touches loses records: dropped."""
        return self.skip_range(batch.actor_id, batch.first_seq, batch.last_seq,
                               batch.arrays.get("episode"))

    def skip_range(self, actor: str, first: int, last: int, episodes=None) -> int:
        """Consume sequence numbers ``first..last`` of a batch rejected before it could be read
        as one (its ``episodes`` array, when readable, names the episodes it touched; without
        it any open episode of the actor is dropped); returns the ack. A range already
        consumed changes nothing. Raises TransitionError for a range after a gap (nothing
        consumed: the actor resends from its ack first)."""
        with self._lock:
            have = self.received.get(actor, -1)
            if first > have + 1:
                raise TransitionError(f"sequence gap: expected seq {have + 1}, batch starts at {first}")
            if have < last:
                self._consume_rejected(actor, first, last, episodes, "a rejected batch")
            return self.acked.get(actor, -1)

    def add(self, batch: TransitionBatch) -> tuple[int, int, str | None]:
        """Store new records of a validated ``batch``; returns (acked seq, duplicates dropped,
        why its new records were rejected or None). Raises TransitionError for a sequence gap
        (nothing consumed: the actor resends)."""
        with self._lock:
            actor = batch.actor_id
            have = self.received.get(actor, -1)
            if batch.first_seq > have + 1:
                raise TransitionError(
                    f"sequence gap: expected seq {have + 1}, batch starts at {batch.first_seq}"
                )
            dup = min(len(batch), have + 1 - batch.first_seq)
            if dup >= len(batch):
                return self.acked.get(actor, -1), dup, None
            new = batch.slice(dup) if dup else batch
            if not self.store_transitions:
                self.received[actor] = new.last_seq
                self.acked[actor] = new.last_seq
                self._acked_here.add(actor)
                self._track(new, np.ones(len(new), bool))
                return new.last_seq, dup, None
            problem = self._check(new)
            if problem is not None:
                reason, detail = problem
                self.rejections[reason] += 1
                log.warning("actor %s: rejected records seq %d..%d: %s: %s", actor, new.first_seq,
                            new.last_seq, reason, detail)
                self._consume_rejected(actor, new.first_seq, new.last_seq, new.arrays.get("episode"),
                                       f"a batch rejected for {reason}")
                return self.acked.get(actor, -1), dup, f"{reason}: {detail}"
            keep = self._route(new)
            if keep.all():
                self.sink.add(new)
            elif keep.any():
                idx = np.flatnonzero(keep)
                self.sink.add(TransitionBatch(actor, new.first_seq + int(idx[0]),
                                                {k: v[idx] for k, v in new.arrays.items()},
                                                [new.tasks[i] for i in idx]))
            self.received[actor] = new.last_seq
            self._settle(actor)
            self._track(new, keep)
            if self.staged_bytes > self.max_staged_bytes:
                self._bound_staged()
            return self.acked.get(actor, -1), dup, None

    def _check(self, b: TransitionBatch) -> tuple[str, str] | None:
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
                continue  # discarded in _route, not a rejection
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

    def _route(self, b: TransitionBatch) -> np.ndarray:
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
            self.max_episode[actor] = max(self.max_episode.get(actor, -1), ep)
            if ep in st.dropped:
                keep[i:j] = False
                self.discarded_records += j - i
                i = j
                continue
            op = st.open
            if op is not None and op.episode != ep:
                self._drop_open(actor, "unfinished",
                                f"the actor moved on to episode {ep} without finishing it")
                op = None
            if op is None:
                if steps[i] != 0:
                    st.dropped.add(ep)
                    self.dropped_episodes["start_missing"] += 1
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
                self._drop_open(actor, "too_long", f"more than {self.max_episode_records} records "
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

    def _bound_staged(self) -> None:
        """Over ``max_staged_bytes`` of unfinished episodes (all actors): drop the oldest open
        episodes until under it. Each is counted (``dropped_episodes["evicted"]``) and logged;
        its records were never acknowledged (an open episode holds its actor's ack), so its
        actor's ack moves past them and they are never stored: nothing acknowledged is lost."""
        while self.staged_bytes > self.max_staged_bytes and self._staged:
            actor = next(iter(self._staged))
            self._drop_open(actor, "evicted", f"{self.staged_bytes} bytes of unfinished episodes "
                            f"staged, over the limit of {self.max_staged_bytes} (all actors): the "
                            "oldest goes")
            self._settle(actor)

    def _drop_open(self, actor: str, reason: str, why: str) -> None:
        st = self._actors[actor]
        op = st.open
        if op is None:
            return
        st.open = None
        self._release(actor, op)
        op.chunks = []
        st.dropped.add(op.episode)
        self.dropped_episodes[reason] += 1
        self._running.pop((actor, op.episode), None)
        if hasattr(self.sink, "abandon"):
            self.sink.abandon(actor, op.episode)
        log.warning("actor %s: episode %d dropped (%s): %s; it is not written to the dataset",
                    actor, op.episode, reason, why)

    def _consume_rejected(self, actor: str, first: int, last: int, ep_arr, what: str) -> None:
        """Sequence numbers ``first..last`` of a rejected batch are consumed; an open episode
        it touches (or, when its episode ids ``ep_arr`` are unreadable, any open episode of the
        actor) is dropped."""
        st = self._actors[actor]
        try:
            flat = np.asarray(ep_arr).reshape(-1)
            touched = set(flat.astype(np.int64).tolist()) if len(flat) == last - first + 1 else None
        except (TypeError, ValueError):
            touched = None
        if st.open is not None and (touched is None or st.open.episode in touched):
            self._drop_open(actor, "lost_records", f"records {first}..{last} went to {what}")
        self.received[actor] = max(self.received.get(actor, -1), last)
        self._settle(actor)

    def _acked_for(self, actor: str, settled: set[tuple[str, int]] = frozenset()) -> int:
        st = self._actors[actor]
        lows = [fs for ep, fs in st.pending.items() if (actor, ep) not in settled]
        if st.open is not None and self.store is not None:
            lows.append(st.open.first_seq)
        rec = self.received.get(actor, -1)
        return min(min(lows) - 1, rec) if lows else rec

    def _settle(self, actor: str) -> int:
        new = self._acked_for(actor)
        if new > self.acked.get(actor, -1):
            self.acked[actor] = new
            self._acked_here.add(actor)
        return self.acked.get(actor, -1)

    # ---- store callbacks (the store's writer thread) ---------------------------------------

    def _ack_preview(self, episodes) -> dict[str, int]:
        with self._lock:
            settled = {ep.key for ep in episodes}
            return {actor: max(self.acked.get(actor, -1), self._acked_for(actor, settled))
                    for actor in {ep.actor_id for ep in episodes}}

    def _on_durable(self, durable, dropped) -> None:
        advanced: list[tuple[str, int]] = []
        with self._lock:
            for ep in list(durable) + list(dropped):
                self._actors[ep.actor_id].pending.pop(ep.episode, None)
            self.dropped_episodes["store_refused"] += len(dropped)
            for actor in {ep.actor_id for ep in list(durable) + list(dropped)}:
                before = self.acked.get(actor, -1)
                if self._settle(actor) > before:
                    advanced.append((actor, self.acked[actor]))
        if self.on_ack is not None:
            for actor, seq in advanced:
                try:
                    self.on_ack(actor, seq)
                except Exception:  # pragma: no cover - the learner's push failed
                    log.exception("pushing the ack of actor %s failed", actor)

    # ---- statistics -------------------------------------------------------------------------

    def _track(self, b: TransitionBatch, keep: np.ndarray) -> None:
        a, actor, kept = b.arrays, b.actor_id, keep.tolist()
        cols = [a[k].tolist() for k in ("episode", "is_last", "reward", "success", "terminated", "truncated")]
        for i, (ep, last, rew, succ, term, trunc) in enumerate(zip(*cols, strict=True)):
            if ep > self.max_episode.get(actor, -1):
                self.max_episode[actor] = ep
            if not kept[i]:
                continue
            if last:
                self._running.pop((actor, ep), None)
                continue
            self.steps += 1
            run = self._running.setdefault((actor, ep), [0.0, False, 0])
            run[0] += rew
            run[1] = run[1] or bool(succ)
            run[2] += 1
            if term or trunc:
                self.stats.add(b.tasks[i] or "default", run[0], run[1], run[2])
                self._running.pop((actor, ep), None)
        if self.on_records is not None:
            try:
                self.on_records(b, keep)
            except Exception:  # pragma: no cover - a view must never break ingest
                log.exception("records observer failed")

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        with self._lock:
            return {"received": dict(self.acked if self.store is not None else self.received),
                    "acked": dict(self.acked), "max_episode": dict(self.max_episode),
                    "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore counters from a checkpoint. With an episode store, the dataset's commit
        record is the authority on what was acknowledged: a checkpoint never lowers it, and
        records after it (not durable when the learner stopped) are expected again."""
        with self._lock:
            acked = {k: int(v) for k, v in state.get("acked", {}).items()}
            max_ep = {k: int(v) for k, v in state.get("max_episode", {}).items()}
            if self.store is not None:
                for k, v in acked.items():
                    self.acked[k] = max(v, self.acked.get(k, -1))
                self.received = dict(self.acked)
            else:
                self.received = {k: int(v) for k, v in state.get("received", {}).items()}
                self.acked = acked
            for k, v in max_ep.items():
                self.max_episode[k] = max(v, self.max_episode.get(k, -1))
            self.steps = int(state.get("steps", 0))


def _episode(actor: str, op: _StagedEpisode):
    from data.store import Episode

    keys = op.chunks[0][0].keys()
    arrays = {k: np.concatenate([c[0][k] for c in op.chunks]) for k in keys}
    tasks = [t for c in op.chunks for t in c[1]]
    seqs = np.concatenate([c[2] for c in op.chunks])
    op.chunks = []
    return Episode(actor, op.episode, arrays, tasks, seqs)
