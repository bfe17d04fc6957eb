"""Rejection sampling's builder (:class:`agents.core.Builder`): its data (the replay ring,
refilled from the LeRobot episode store, with an outcome-scoring sink in front and the
success store as a view of it; demos mixed in), its evaluation jobs and its cadence.

The cadence is :mod:`agents.rs.learning`'s, the data :mod:`agents.rs.data`'s, the
evaluation jobs :mod:`agents.rs.jobs`'.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from agents.base import check_pair
from agents.core import Builder
from agents.rs.agent import BCAgent, RejectionSamplingConfig
from agents.rs.data import OutcomeSink, RSData
from agents.rs.jobs import EVAL_GROUP_BASE, EvalJobs
from agents.rs.learning import RSLearner
from data.core.spec import EnvSpec
from data.sampler import MixedSampler, SuccessView, build_replay, groups_from


class _Override:
    """A config section with some keys replaced (``get`` only, as build_replay reads it)."""

    def __init__(self, cfg, **over):
        self.cfg, self.over = cfg, over

    def get(self, key, default=None):
        if key in self.over:
            return self.over[key]
        get = self.cfg.get if hasattr(self.cfg, "get") else (lambda k, d=None: getattr(self.cfg, k, d))
        return get(key, default)


class RejectionSamplingBuilder(Builder):
    name = "rejection_sampling"

    def __init__(self, cfg: RejectionSamplingConfig):
        super().__init__(cfg)
        self._jobs: EvalJobs | None = None

    def make_networks(self, spec: EnvSpec, policy, device) -> SimpleNamespace:
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        return SimpleNamespace(spec=spec, policy=policy)

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> RSData:
        get = replay_cfg.get if hasattr(replay_cfg, "get") else (lambda k, d=None: getattr(replay_cfg, k, d))
        rep = build_replay(_Override(replay_cfg, refill=False), spec, run_dir=run_dir, seed=seed,
                           device=device, train=train)
        sink = OutcomeSink(rep.buffer, self.cfg)
        if train and rep.store is not None and get("refill", True):
            rep.store.load_into(sink)  # through the sink: outcomes decided as on arrival
        exclude = None if self.cfg.train_on_eval else groups_from(EVAL_GROUP_BASE)
        success = SuccessView(rep.buffer, include_interventions=self.cfg.keep_interventions,
                              exclude=exclude)
        sampler: Any = success
        if rep.demo is not None:
            ratio = self.cfg.demo_ratio if self.cfg.demo_ratio is not None else float(get("demo_ratio", 0.5))
            sampler = MixedSampler(success, rep.demo, demo_ratio=ratio)
        return RSData(rep, sink, success, sampler, rep.demo, train=train)

    def make_learner(self, networks, data: RSData, accelerator, *,
                     env_steps: Callable[[], int]) -> RSLearner:
        if self.cfg.pretrain_steps > 0 and data.train and data.demo is None:
            raise ValueError("algo=rejection_sampling: pretrain_steps > 0 needs demonstrations "
                             "(buffer.demos=<LeRobot dataset>, e.g. from tools/record_demos.py)")
        agent = BCAgent(self.cfg, networks.policy, accelerator)
        self._jobs = EvalJobs() if data.train and self.cfg.eval_jobs() else None
        return RSLearner(self.cfg, agent, data, self._jobs or EvalJobs(), env_steps=env_steps,
                         horizon=int(getattr(networks.policy, "chunk_size", 1)))

    def jobs(self):
        return self._jobs
