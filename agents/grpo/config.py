"""GRPO's configuration: :class:`agents.grpo.agent.GRPOConfig` (the update) plus the job
source and the round cadence (:mod:`agents.grpo.jobs`)."""

from __future__ import annotations

from dataclasses import dataclass

from agents.grpo.agent import GRPOConfig

SEEDS = ("distinct", "shared")


@dataclass
class GRPOBuilderConfig(GRPOConfig):
    """:class:`agents.grpo.agent.GRPOConfig` plus the job source and the round cadence."""

    #: the tasks groups are made for, in turn (env task indices)
    task_ids: tuple[int, ...] = (0,)
    #: initial states are drawn from range(num_init_states) (0: any int, a fresh one per group)
    num_init_states: int = 0
    #: seed of the job source's RNG (initial states, reset seeds)
    jobs_seed: int = 0
    #: reset seeds: "distinct" (each job of a group its own) or "shared" (one per group)
    seeds: str = "distinct"
    #: a handed-out job with no finished episode after this long is handed out again
    job_timeout_s: float = 120.0
    #: the learner waits this long for a round's groups before using the ones it has
    round_timeout_s: float = 300.0
    #: after a timeout, groups with at least this many episodes are used
    min_group_size: int = 2
    #: rounds issued ahead of the one the learner waits for (needs max_staleness >= it)
    prefetch_rounds: int = 1
    #: finished episodes the rollout queue holds at most (beyond: oldest dropped, counted)
    max_queued_episodes: int = 1024
    #: updates over which the policy's lr rises linearly from lr / n to lr (0: off)
    lr_warmup_updates: int = 0

    def validate(self) -> None:
        if not self.task_ids or any(int(t) < 0 for t in self.task_ids):
            raise ValueError(f"task_ids must be non-empty task indices, got {self.task_ids}")
        if self.lr_warmup_updates < 0:
            raise ValueError(f"lr_warmup_updates must be >= 0, got {self.lr_warmup_updates}")
        if self.seeds not in SEEDS:
            raise ValueError(f"seeds must be one of {SEEDS}, got {self.seeds!r}")
        if not 2 <= self.min_group_size <= self.group_size:
            raise ValueError(f"min_group_size must be in [2, group_size], got {self.min_group_size}")
        if self.prefetch_rounds < 0 or self.num_init_states < 0:
            raise ValueError("prefetch_rounds and num_init_states must be >= 0")
        if self.max_staleness < self.prefetch_rounds:
            raise ValueError(f"prefetch_rounds={self.prefetch_rounds} makes episodes that many "
                             f"versions stale: set max_staleness >= prefetch_rounds")
        if min(self.job_timeout_s, self.round_timeout_s) <= 0:
            raise ValueError("job_timeout_s and round_timeout_s must be > 0")

    @property
    def jobs_per_group(self) -> int:
        return self.group_size + (self.estimator == "remax")
