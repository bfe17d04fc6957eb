"""Transition batches: building them on the actor, validating them on the learner.

See :mod:`data.core.schema` for the layout. :meth:`TransitionBatch.validate` is the learner's
check of untrusted input against the agreed :class:`data.core.spec.EnvSpec` (policy extras
included: exactly ``spec.extra_keys``, each [N, *shape] in its declared dtype).
:func:`extras_to_numpy` turns a policy's extras into checked ``extra.<name>`` arrays (the
learner's inference thread and the actor's local policy both use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from data.core.codec import Message, encode
from data.core.schema import EXTRA_PREFIX, OBS_IMAGE_PREFIX, OBS_STATE, STEP_ARRAYS, STEP_DEFAULTS, TASK
from data.core.spec import EXTRA_DTYPES, EnvSpec


_DTYPES = {dt: np.dtype(dt) for dt in ("float32", "uint8", *STEP_ARRAYS.values(), *EXTRA_DTYPES)}
#: lower bounds of integer step arrays (group_id -1: no job)
_MIN = {"chunk_index": 0, "group_id": -1}


class TransitionError(ValueError):
    """A transition batch that does not match the schema or the env spec."""


def extras_to_numpy(extras: dict[str, Any], declared: dict[str, tuple[str, tuple[int, ...]]],
                    n: int) -> dict[str, np.ndarray]:
    """A policy's extras (``ActionChunk.extras_with_log_prob()``: name -> tensor or array
    [n, *shape]) -> ``{"extra.<name>": numpy array}`` in the declared dtype.

    ``declared`` is the policy's ``extras_spec()``: name -> (dtype, per-chunk shape). Raises
    ValueError naming the extra when one is missing, undeclared, of the wrong shape or not
    finite. Torch tensors are moved to the CPU (bfloat16 goes through float32) without
    importing torch here.
    """
    missing = sorted(set(declared) - set(extras))
    undeclared = sorted(set(extras) - set(declared))
    if missing or undeclared:
        raise ValueError(f"policy extras do not match its extras_spec(): missing {missing}, "
                         f"undeclared {undeclared}")
    out = {}
    for name, (dt, shape) in declared.items():
        v = extras[name]
        if hasattr(v, "detach"):  # a torch tensor
            v = v.detach()
            if v.is_floating_point():
                v = v.float()
            v = v.cpu().numpy()
        a = np.asarray(v)
        want = (n, *tuple(shape))
        if a.shape != want:
            raise ValueError(f"policy extra {name!r}: shape {tuple(a.shape)}, declared {want}")
        a = np.ascontiguousarray(a.astype(_DTYPES[dt], copy=False))
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"policy extra {name!r} contains NaN or Inf")
        out[EXTRA_PREFIX + name] = a
    return out


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
        dtypes, non-finite values, values outside the spec's ranges (integer extras'
        :attr:`~data.core.spec.EnvSpec.extra_ranges`, float fields'
        :attr:`~data.core.spec.EnvSpec.float_ranges`), or seq numbers that do not match the
        record count."""
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
        for name, (dt, shape) in spec.extras.items():
            expected[EXTRA_PREFIX + name] = (dt, tuple(shape))
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
            if k in _MIN and n and int(arr.min()) < _MIN[k]:
                raise TransitionError(f"{k}: values must be >= {_MIN[k]}, got {int(arr.min())}")
        for name, (lo, hi) in spec.extra_ranges.items():
            arr = a[EXTRA_PREFIX + name]
            if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
                raise TransitionError(f"{EXTRA_PREFIX}{name}: values must be in {lo}..{hi}, got "
                                      f"{int(arr.min())}..{int(arr.max())}")
        for k, (lo, hi) in spec.float_ranges.items():  # finite but extreme overflows a loss
            arr = a[k]
            if arr.size:
                amin, amax = float(arr.min()), float(arr.max())
                if amin < lo or amax > hi:
                    raise TransitionError(f"{k}: values must be in [{lo:g}, {hi:g}] (the spec's "
                                          f"value range), got {amin:g}..{amax:g}")
        if len(self.tasks) != n or not all(isinstance(t, str) for t in self.tasks):
            raise TransitionError(f"tasks: expected {n} strings")
        if self.first_seq < 0:
            raise TransitionError(f"first_seq must be >= 0, got {self.first_seq}")
        last = a["is_last"]
        if (last & (a["terminated"] | a["truncated"])).any():
            raise TransitionError("an is_last record cannot itself terminate or truncate")
