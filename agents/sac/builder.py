"""SAC's builder: its networks (critic ensemble for any policy), its data (replay ring with
the episode store and the RLPD demo mix), its cadence and what it publishes (the policy's
trainable weights every ``publish_every`` updates). See :class:`agents.core.Builder`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from agents.base import check_pair
from agents.core import Builder
from agents.common.critics import EnsembleCritic
from agents.sac.off_policy import OffPolicyLearner
from agents.sac.agent import SACAgent, make_critic
from data.core.spec import EnvSpec
from data.sampler import Replay, build_replay


@dataclass
class SACNetworks:
    spec: EnvSpec
    policy: Any
    critic: EnsembleCritic


class SACBuilder(Builder):
    name = "sac"

    def make_networks(self, spec: EnvSpec, policy, device: torch.device) -> SACNetworks:
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        return SACNetworks(spec, policy, make_critic(self.cfg, spec, policy))

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> Replay:
        return build_replay(replay_cfg, spec, run_dir=run_dir, seed=seed, device=device, train=train)

    def make_learner(self, networks: SACNetworks, data: Replay, accelerator,
                     *, env_steps: Callable[[], int]) -> OffPolicyLearner:
        agent = SACAgent(self.cfg, networks.policy, networks.spec, accelerator, critic=networks.critic)
        return OffPolicyLearner(agent, data.sampler, batch_size=self.cfg.batch_size,
                                env_steps=env_steps, learning_starts=self.cfg.learning_starts,
                                max_update_ratio=self.cfg.max_update_ratio,
                                publish_every=self.cfg.publish_every,
                                horizon=int(getattr(networks.policy, "chunk_size", 1)))

