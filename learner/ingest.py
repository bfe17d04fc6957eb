"""Ingest: per-actor sequence numbers, storage, durable acks, statistics.

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

Each actor's episodes (checks, staging for the store, drops) are
:class:`learner.episodes.ActorEpisodes`'s: a batch that breaks an episode is rejected (counted
in ``rejections`` under its reason and logged; the whole batch is consumed and nothing stored
changes), and an episode that cannot be completed is dropped (``dropped_episodes`` by reason):
its records were never acknowledged (an open episode holds its actor's ack); the ack then
moves past them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

import numpy as np

from data.core.transitions import TransitionBatch, TransitionError
from learner.episode_stats import EpisodeStats
from learner.episodes import ActorEpisodes

log = logging.getLogger("tandem.learner.ingest")


class Ingest:
    """Thread-safe front of the algorithm's sink (:class:`agents.core.Sink`: the replay ring
    for SAC) and the episode store; called from the service thread (``add``, ``skip``,
    ``resync``) and the store's writer thread (callbacks)."""

    def __init__(self, sink, *, store=None, store_transitions: bool = True,
                 stats_window: int = 100, on_ack: Callable[[str, int], None] | None = None,
                 max_episode_records: int = 100_000, max_staged_bytes: int = 1 << 30):
        self.sink = sink
        self.store_transitions = store_transitions
        self.store = store if store_transitions else None
        self.episodes = ActorEpisodes(store=self.store, max_episode_records=max_episode_records,
                                      max_staged_bytes=max_staged_bytes, on_drop=self._on_drop)
        self.dropped_episodes: Counter[str] = self.episodes.dropped  # by reason
        self.on_ack = on_ack
        self.stats = EpisodeStats(window=stats_window)
        self.received: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        self._acked_here: set[str] = set()  # actors this process has acknowledged records of
        self.max_episode: dict[str, int] = {}
        self.rejections: Counter[str] = Counter()
        self.steps = 0  # env steps stored (is_last records excluded)
        self._running: dict[tuple[str, int], list] = {}  # (actor, episode) -> [return, success, len]
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
                self.episodes.drop_open(actor_id, "records_lost",
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
            problem = self.episodes.check(new)
            if problem is not None:
                reason, detail = problem
                self.rejections[reason] += 1
                log.warning("actor %s: rejected records seq %d..%d: %s: %s", actor, new.first_seq,
                            new.last_seq, reason, detail)
                self._consume_rejected(actor, new.first_seq, new.last_seq, new.arrays.get("episode"),
                                       f"a batch rejected for {reason}")
                return self.acked.get(actor, -1), dup, f"{reason}: {detail}"
            keep = self.episodes.route(new)
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
            for evicted in self.episodes.evict():
                self._settle(evicted)
            return self.acked.get(actor, -1), dup, None

    def _on_drop(self, actor: str, episode: int) -> None:
        self._running.pop((actor, episode), None)
        if hasattr(self.sink, "abandon"):
            self.sink.abandon(actor, episode)

    def _consume_rejected(self, actor: str, first: int, last: int, ep_arr, what: str) -> None:
        """Sequence numbers ``first..last`` of a rejected batch are consumed; an open episode
        it touches (or, when its episode ids ``ep_arr`` are unreadable, any open episode of the
        actor) is dropped."""
        self.episodes.drop_touched(actor, first, last, ep_arr, what)
        self.received[actor] = max(self.received.get(actor, -1), last)
        self._settle(actor)

    def _acked_for(self, actor: str, settled: set[tuple[str, int]] = frozenset()) -> int:
        held = self.episodes.holds(actor, settled)
        rec = self.received.get(actor, -1)
        return rec if held is None else min(held - 1, rec)

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
            self.episodes.settled(list(durable) + list(dropped))
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

