"""Rejection sampling's data: the outcome-scoring sink in front of the replay ring, and
:class:`RSData` (replay, sink, success store, sampler, demos).

The success store is :class:`data.sampler.SuccessView` over the replay: transitions of
episodes whose outcome is a success (:func:`agents.rs.agent.episode_outcome`;
:class:`OutcomeSink` writes it into the buffer's copy of each episode's final record) plus
intervened steps, evaluation episodes held out. A restarted learner refills the replay
from the dataset through the same sink, so the store comes back as it was.

``RSData.status()`` (``status.json`` -> ``replay``) reports the store and, under ``rs``,
the learner's phase, counters and evaluation history.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from agents.rs.agent import RejectionSamplingConfig, episode_outcome
from agents.rs.jobs import EVAL_GROUP_BASE
from data.sampler import Replay, SuccessView
from data.core.transitions import TransitionBatch


class OutcomeSink:
    """Ingest's sink: decides each finished episode's outcome, writes it into the buffer's
    copy of its final record's ``success`` (the dataset keeps the env's flag), adds the
    records to the replay buffer, counts, and reports finished evaluation episodes
    (``on_eval(actor_id, episode, group_id, success, min_policy_version, intervened)``)."""

    def __init__(self, buffer, cfg: RejectionSamplingConfig):
        self.buffer = buffer
        self.cfg = cfg
        self.on_eval: Callable[..., None] | None = None
        self.counters: Counter[str] = Counter()
        self._open: dict[tuple[str, int], list] = {}  # -> [return, min version, intervened steps]
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.buffer.capacity

    @property
    def total_added(self) -> int:
        return self.buffer.total_added

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, batch: TransitionBatch, *, restored: bool = False) -> int:
        a = batch.arrays
        relabel = self.cfg.success_from != "success"
        success = a["success"].copy() if relabel else a["success"]
        ended = []
        with self._lock:
            for i in range(len(batch)):
                key = (batch.actor_id, int(a["episode"][i]))
                run = self._open.setdefault(key, [0.0, math.inf, 0])
                if not a["is_last"][i]:
                    run[0] += float(a["reward"][i])
                    run[1] = min(run[1], int(a["policy_version"][i]))
                    run[2] += bool(a["intervened"][i])
                    continue
                del self._open[key]
                ok = episode_outcome(bool(a["success"][i]), run[0], self.cfg)
                success[i] = ok
                ended.append((key, int(a["group_id"][i]), ok, run[1], run[2]))
        if relabel:
            batch = TransitionBatch(batch.actor_id, batch.first_seq, {**a, "success": success},
                                    batch.tasks)
        n = self.buffer.add(batch, restored=restored)
        if restored:
            return n
        steps = ~a["is_last"]
        eval_steps = int((steps & (a["group_id"] >= EVAL_GROUP_BASE)).sum())
        with self._lock:
            c = self.counters
            c["eval_steps"] += eval_steps
            c["intervened_steps"] += int((steps & a["intervened"]).sum())
            for _key, group, ok, _v, inter in ended:
                if group >= EVAL_GROUP_BASE:
                    c["eval_episodes"] += 1
                else:
                    c["episodes"] += 1
                    c["kept_episodes"] += ok
                    c["intervened_episodes"] += inter > 0
        for (actor, ep), group, ok, version, inter in ended:
            if group >= EVAL_GROUP_BASE and self.on_eval is not None:
                self.on_eval(actor, ep, group, ok, version, inter)
        return n

    def abandon(self, actor_id: str, episode: int) -> None:
        with self._lock:
            self._open.pop((actor_id, int(episode)), None)
        self.buffer.abandon(actor_id, episode)


@dataclass
class RSData:
    replay: Replay
    sink: OutcomeSink
    success: SuccessView
    sampler: Any
    demo: Any = None
    rs_status: Callable[[], dict] | None = None
    train: bool = True

    @property
    def store(self):
        return self.replay.store

    def status(self) -> dict:
        st = self.replay.status()
        st.update(success_store=len(self.success),
                  success_store_intervened=self.success.count_intervened(),
                  **{k: int(v) for k, v in self.sink.counters.items()})
        if self.rs_status is not None:
            st["rs"] = self.rs_status()
        return st

    def close(self, timeout: float = 30.0) -> None:
        self.replay.close(timeout)
