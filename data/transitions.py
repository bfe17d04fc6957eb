"""Transition batches: building them on the actor, validating them on the learner.

See :mod:`data.core.schema` for the layout. :meth:`TransitionBatch.validate` is the learner's
check of untrusted input against the agreed :class:`data.core.spec.EnvSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from data.core.codec import Message, encode
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, STEP_ARRAYS, STEP_DEFAULTS, TASK
from data.core.spec import EnvSpec


_DTYPES = {dt: np.dtype(dt) for dt in ("float32", "uint8", *STEP_ARRAYS.values())}


class TransitionError(ValueError):
    """A transition batch that does not match the schema or the env spec."""


@dataclass
class TransitionBatch:
    actor_id: str
    first_seq: int
    arrays: dict[str, np.ndarray]
    tasks: list[str]

    def __post_init__(self) -> None:
        # columns a producer may leave out (demos, older datasets, tests) take their defaults
        n = len(self.tasks)
        for k, v in STEP_DEFAULTS.items():
            if k not in self.arrays:
                self.arrays[k] = np.full(n, v, dtype=STEP_ARRAYS[k])

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self) - 1

    def __len__(self) -> int:
        return int(self.arrays["reward"].shape[0])

    def to_frames(self) -> list[Any]:
        return encode(
            "transitions",
            {"actor_id": self.actor_id, "first_seq": self.first_seq,
             "last_seq": self.last_seq, "tasks": self.tasks},
            self.arrays,
        )

    @classmethod
    def from_message(cls, msg: Message) -> "TransitionBatch":
        return cls(msg["actor_id"], msg["first_seq"], dict(msg.arrays), list(msg["tasks"]))

    @classmethod
    def from_records(cls, actor_id: str, first_seq: int, records: Sequence[dict]) -> "TransitionBatch":
        """Stack per-step record dicts (obs keys + STEP_ARRAYS keys + "task"; the keys of
        :data:`STEP_DEFAULTS` may be left out and take their default)."""
        if not records:
            raise TransitionError("no records to stack")
        keys = [k for k in records[0] if k != TASK]
        arrays = {}
        for k in keys:
            dtype = STEP_ARRAYS.get(k)
            stacked = np.stack([np.asarray(r[k]) for r in records])
            arrays[k] = stacked.astype(dtype, copy=False) if dtype else stacked
        return cls(actor_id, first_seq, arrays, [str(r.get(TASK, "")) for r in records])

    def slice(self, start: int) -> "TransitionBatch":
        """The records from index ``start`` on (used to drop already-acked duplicates)."""
        return TransitionBatch(
            self.actor_id, self.first_seq + start,
            {k: v[start:] for k, v in self.arrays.items()}, self.tasks[start:],
        )

    def validate(self, spec: EnvSpec) -> None:
        """Raise TransitionError naming the first problem: missing/extra keys, shapes,
        dtypes, non-finite values, or seq numbers that do not match the record count."""
        a = self.arrays
        n = len(a.get("reward", ()))
        if n == 0:
            raise TransitionError("empty transition batch")
        expected = {OBS_STATE: ("float32", (spec.state_dim,))}
        for cam, shape in spec.cameras.items():
            expected[OBS_IMAGE_PREFIX + cam] = ("uint8", tuple(shape))
        expected["action"] = ("float32", (spec.action_dim,))
        for k, dt in STEP_ARRAYS.items():
            expected.setdefault(k, (dt, ()))
        extra = sorted(set(a) - set(expected))
        if extra:
            raise TransitionError(f"unexpected arrays {extra}")
        for k, (dt, shape) in expected.items():
            if k not in a:
                raise TransitionError(f"missing array {k!r}")
            arr = a[k]
            if arr.dtype != _DTYPES[dt]:
                raise TransitionError(f"{k}: dtype {arr.dtype.name}, expected {dt}")
            if arr.shape != (n, *shape):
                raise TransitionError(f"{k}: shape {tuple(arr.shape)}, expected {(n, *shape)}")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise TransitionError(f"{k}: contains NaN or Inf")
        if len(self.tasks) != n or not all(isinstance(t, str) for t in self.tasks):
            raise TransitionError(f"tasks: expected {n} strings")
        if self.first_seq < 0:
            raise TransitionError(f"first_seq must be >= 0, got {self.first_seq}")
        last = a["is_last"]
        if (last & (a["terminated"] | a["truncated"])).any():
            raise TransitionError("an is_last record cannot itself terminate or truncate")
