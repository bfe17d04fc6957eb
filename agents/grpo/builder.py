"""GRPO's builder: no critic; data = the rollout queue next to the episode store; jobs = a
group job source; cadence = rounds of job groups (:class:`GroupRounds`), one
``GRPOAgent.update`` per round, then a new weights version.
:mod:`agents.grpo.jobs` says how rounds and jobs work; the configuration is
:class:`agents.grpo.config.GRPOBuilderConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from agents.base import check_pair
from agents.core import Builder
from agents.grpo.agent import GRPOAgent
from agents.grpo.config import GRPOBuilderConfig
from agents.grpo.jobs import GroupJobSource, GroupRounds
from agents.ppo.on_policy import OnPolicyLearner
from data.core.spec import EnvSpec
from data.rollouts import Rollouts, build_rollouts

@dataclass
class GRPONetworks:
    spec: EnvSpec
    policy: Any


class GRPOBuilder(Builder):
    name = "grpo"

    def __init__(self, cfg: GRPOBuilderConfig):
        super().__init__(cfg)
        self._jobs: GroupJobSource | None = None

    def make_networks(self, spec: EnvSpec, policy, device: torch.device) -> GRPONetworks:
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        return GRPONetworks(spec, policy)

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> Rollouts:
        data = build_rollouts(replay_cfg, spec, run_dir=run_dir, train=train,
                              max_episodes=self.cfg.max_queued_episodes,
                              max_staleness=self.cfg.max_staleness)
        if train:
            self._jobs = GroupJobSource(self.cfg)
            data.queue.on_finished.append(self._jobs.episode_finished)
            data.queue.on_abandoned.append(self._jobs.episode_abandoned)
        return data

    def make_learner(self, networks: GRPONetworks, data: Rollouts, accelerator,
                     *, env_steps: Callable[[], int]) -> OnPolicyLearner:
        agent = GRPOAgent(self.cfg, networks.policy, accelerator)
        source = self._jobs or GroupJobSource(self.cfg)
        rounds = GroupRounds(data.queue, source, self.cfg,
                             horizon=int(getattr(networks.policy, "chunk_size", 1)))
        return OnPolicyLearner(agent, rounds, publish_every=self.cfg.publish_every,
                               lr_warmup=self.cfg.lr_warmup_updates)

    def jobs(self) -> GroupJobSource | None:
        """The group job source (None outside training: actors then run as they like)."""
        return self._jobs
