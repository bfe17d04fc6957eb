"""Learner-driven episodes: a :class:`Job` tells an actor exactly how to run its next episode.

The learner hands one out in reply to ``get_job`` (see :mod:`data.core.schema`); the actor
resets its env with ``seed`` and ``options={"task_id": ..., "init_state": ...}``, acts
deterministically if asked, and writes ``group_id`` into every record of the episode. GRPO
groups, ReMax greedy baselines and evaluation sweeps over init states are made of jobs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: the largest value a job's integer fields may take (they travel as msgpack ints)
MAX_JOB_INT = 2**31 - 1
NO_GROUP = -1


@dataclass(frozen=True)
class Job:
    job_id: int
    task_id: int = 0
    init_state: int = 0
    seed: int = 0
    group_id: int = NO_GROUP
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("job_id", "task_id", "init_state", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_JOB_INT:
                raise ValueError(f"job {name} must be an int in [0, {MAX_JOB_INT}], got {v!r}")
        if not isinstance(self.group_id, int) or not -1 <= self.group_id <= MAX_JOB_INT:
            raise ValueError(f"job group_id must be an int in [-1, {MAX_JOB_INT}], got {self.group_id!r}")

    def to_fields(self) -> dict:
        return asdict(self)

    @classmethod
    def from_fields(cls, fields: dict) -> "Job":
        return cls(**{k: fields[k] for k in ("job_id", "task_id", "init_state", "seed",
                                              "group_id", "deterministic")})

    def reset_options(self) -> dict:
        """``env.reset(seed=job.seed, options=job.reset_options())``."""
        return {"task_id": self.task_id, "init_state": self.init_state}
