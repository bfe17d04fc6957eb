"""PPO's builder: its networks (the policy, plus a value net unless the policy has its own
value head), its data (the rollout queue next to the episode store), its cadence (rounds of
``batch_episodes`` fresh episodes, one ``PPOAgent.update`` each, then a new weights version)
and no jobs: actors run freely. See :class:`agents.core.Builder`, :mod:`agents.ppo.on_policy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from agents.common.advantages import NEEDS_VALUES
from agents.base import ValuePolicy, check_pair, has_capability
from agents.core import Builder
from agents.ppo.on_policy import EpisodeRounds, OnPolicyLearner
from agents.ppo.agent import PPOAgent, PPOConfig
from agents.common.value import ValueNet, ValueNetConfig
from data.core.spec import EnvSpec
from data.rollouts import Rollouts, build_rollouts

#: the estimators PPO runs without job groups
PPO_ESTIMATORS = ("gae", "reinforce_pp")


@dataclass
class PPOBuilderConfig(PPOConfig):
    """:class:`agents.ppo.agent.PPOConfig` plus what the builder makes: the value net (used when
    the estimator needs values and the policy is not a ValuePolicy) and the rollout queue."""

    #: value net: widths of its hidden layers
    value_hidden_dims: tuple[int, ...] = (64, 64)
    #: value net: activation ("tanh", "relu", "elu", "gelu", "silu")
    value_activation: str = "tanh"
    #: value net: conv channels of its per-camera CNN (unused without cameras)
    value_cnn_channels: tuple[int, ...] = (16, 16)
    #: value net: per-camera embedding size
    value_image_embed_dim: int = 32
    #: value net: state MLP width with cameras (0: the raw state)
    value_state_embed_dim: int = 32
    #: value net: hash buckets of a task-instruction embedding (0: the task is not an input)
    value_task_buckets: int = 0
    #: finished episodes the rollout queue holds at most (beyond: the oldest are dropped)
    max_queued_episodes: int = 1024
    #: updates over which the policy's lr rises linearly from lr / n to lr (0: off)
    lr_warmup_updates: int = 0
    #: a round also waits until its episodes hold this many chunks (0: episodes alone decide)
    min_batch_chunks: int = 0

    def validate(self) -> None:
        if self.estimator not in PPO_ESTIMATORS:
            raise ValueError(f"algo=ppo runs estimator {' or '.join(PPO_ESTIMATORS)}, got "
                             f"{self.estimator!r} (group estimators need jobs: use algo=grpo)")
        if self.lr_warmup_updates < 0:
            raise ValueError(f"lr_warmup_updates must be >= 0, got {self.lr_warmup_updates}")
        if self.max_queued_episodes < self.batch_episodes:
            raise ValueError(f"max_queued_episodes ({self.max_queued_episodes}) < batch_episodes "
                             f"({self.batch_episodes})")

    def value_net_config(self) -> ValueNetConfig:
        return ValueNetConfig(hidden_dims=tuple(self.value_hidden_dims),
                              activation=self.value_activation,
                              cnn_channels=tuple(self.value_cnn_channels),
                              image_embed_dim=self.value_image_embed_dim,
                              state_embed_dim=self.value_state_embed_dim,
                              task_buckets=self.value_task_buckets)


@dataclass
class PPONetworks:
    spec: EnvSpec
    policy: Any
    #: the value function: a ValueNet, the policy itself (a ValuePolicy), or None
    value: Any = None


class PPOBuilder(Builder):
    name = "ppo"

    def make_networks(self, spec: EnvSpec, policy, device: torch.device) -> PPONetworks:
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        value = None
        if self.cfg.estimator in NEEDS_VALUES:
            value = (policy if has_capability(policy, ValuePolicy)
                     else ValueNet(self.cfg.value_net_config(), spec))
        return PPONetworks(spec, policy, value)

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> Rollouts:
        return build_rollouts(replay_cfg, spec, run_dir=run_dir, train=train,
                              max_episodes=self.cfg.max_queued_episodes,
                              max_staleness=self.cfg.max_staleness)

    def make_learner(self, networks: PPONetworks, data: Rollouts, accelerator,
                     *, env_steps: Callable[[], int]) -> OnPolicyLearner:
        agent = PPOAgent(self.cfg, networks.policy, networks.value, accelerator)
        value_fn = None if networks.value is None else networks.value.value
        rounds = EpisodeRounds(data.queue, batch_episodes=self.cfg.batch_episodes,
                               horizon=int(getattr(networks.policy, "chunk_size", 1)),
                               gamma=self.cfg.gamma, lam=self.cfg.lam,
                               estimator=self.cfg.estimator, value_fn=value_fn,
                               device=agent.device, min_chunks=self.cfg.min_batch_chunks,
                               episode_mean=self.cfg.loss_agg == "episode_mean")
        return OnPolicyLearner(agent, rounds, publish_every=self.cfg.publish_every,
                               lr_warmup=self.cfg.lr_warmup_updates)
