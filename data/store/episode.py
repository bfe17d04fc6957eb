"""A finished episode of one actor, as the store queues and writes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.core.transitions import TransitionBatch


@dataclass
class Episode:
    """A finished episode of one actor: records in step order (the last one ``is_last``),
    in the schema layout, with each record's sequence number."""

    actor_id: str
    episode: int
    arrays: dict[str, np.ndarray]
    tasks: list[str]
    seqs: np.ndarray

    def __len__(self) -> int:
        return int(self.arrays["reward"].shape[0])

    @property
    def first_seq(self) -> int:
        return int(self.seqs.min())

    @property
    def last_seq(self) -> int:
        return int(self.seqs.max())

    @property
    def key(self) -> tuple[str, int]:
        return self.actor_id, self.episode

    @classmethod
    def from_batch(cls, batch: TransitionBatch) -> "Episode":
        """One batch holding exactly one whole episode (tests, tools)."""
        eps = np.unique(batch.arrays["episode"])
        if len(eps) != 1:
            raise ValueError(f"batch holds episodes {eps.tolist()}, expected one")
        return cls(batch.actor_id, int(eps[0]), dict(batch.arrays), list(batch.tasks),
                   np.arange(batch.first_seq, batch.first_seq + len(batch), dtype=np.int64))
