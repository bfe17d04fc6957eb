"""Noise-space SAC's builder (``algo=sac_noise``, see :mod:`agents.sac.noise`).

- the policy the learner trains and serves is :class:`agents.sac.noise_actor.NoiseSpacePolicy`
  around the configured PI0/PI0.5 (:meth:`NoiseSACBuilder.wrap_policy`; the registry calls it
  for the trained copy and the serving copy alike), so what is served is
  PI0(noise = noise_actor(features)) and what is published is the noise actor alone;
- the data: the replay ring and the episode store as for SAC, sampled as chunk windows that
  start at a chunk start (one executed chunk = one transition, its ``extra.noise`` the
  action). Demonstrations (``buffer.demos``) are not mixed in: their noise is unknown
  (nothing produced their actions from a noise); they are ignored, with a warning;
- the cadence: :class:`agents.sac.off_policy.OffPolicyLearner` (learning_starts, update ratio,
  publish_every) with windows of ``execute_steps`` (0: ``chunk_size``) steps.

Actors run the whole chunk (``chunk.execute`` = 0 or ``algo.execute_steps``) in remote mode:
a local-mode actor builds a plain PI0 and cannot load the noise actor's weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from agents.base import check_pair
from agents.core import Builder
from agents.common.critics import EnsembleCritic
from agents.sac.noise_actor import NoiseSpacePolicy
from agents.sac.noise import FrozenBaseSACConfig, NoiseSACAgent, make_noise_critic
from agents.sac.off_policy import OffPolicyLearner
from data.core.spec import EnvSpec
from data.sampler import Replay, build_replay

log = logging.getLogger("tandem.agents.sac.noise")


class ChunkStartView:
    """The buffer's transitions whose step starts a policy chunk (``chunk_start``: the policy
    was asked at that observation and its first action was executed; never a person's step)."""

    def __init__(self, buffer):
        self.buffer = buffer

    @staticmethod
    def _where(b) -> np.ndarray:
        return b._flags["chunk_start"]  # noqa: SLF001 - read under the buffer's lock

    def __len__(self) -> int:
        return self.buffer.count(self._where)

    def sample(self, n: int, **kw) -> dict[str, Any]:
        return self.buffer.sample(n, where=self._where, **kw)


@dataclass
class NoiseSACNetworks:
    spec: EnvSpec
    policy: NoiseSpacePolicy
    critic: EnsembleCritic


class NoiseSACBuilder(Builder):
    """Noise-space SAC's builder; the residual-SAC builder (:mod:`agents.sac.residual_builder`)
    reuses everything but the wrapped policy, the critic, the agent class and the demo note."""

    name = "sac_noise"
    cfg: FrozenBaseSACConfig
    #: the update (:class:`agents.sac.noise.NoiseSACAgent` or a subclass)
    agent_cls: type = NoiseSACAgent
    #: why demonstrations are not mixed in (logged when ``buffer.demos`` is set)
    demos_ignored = "noise-space SAC ignores buffer.demos: demonstrations carry no flow noise"

    def wrap_policy(self, policy) -> NoiseSpacePolicy:
        """The noise-space policy around a freshly built flow policy (idempotent)."""
        if isinstance(policy, NoiseSpacePolicy):
            return policy
        check_pair(self.name, self.requires, type(policy).__name__, policy)
        c = self.cfg
        return NoiseSpacePolicy(policy, noise_dims=c.noise_dims, scale=c.noise_scale,
                                hidden_dims=tuple(c.noise_actor_hidden_dims), activation_name=c.critic_activation)

    def horizon(self, policy) -> int:
        return int(self.cfg.execute_steps or policy.chunk_size)

    def make_networks(self, spec: EnvSpec, policy, device: torch.device) -> NoiseSACNetworks:
        policy = self.wrap_policy(policy)
        if self.horizon(policy) > policy.chunk_size:
            raise ValueError(f"algo.execute_steps={self.cfg.execute_steps} > policy.chunk_size={policy.chunk_size}")
        return NoiseSACNetworks(spec, policy, self.make_critic(policy))

    def make_critic(self, policy) -> EnsembleCritic:
        return make_noise_critic(self.cfg, policy)

    def make_data(self, spec: EnvSpec, replay_cfg, *, run_dir, seed: int, device: str,
                  train: bool) -> Replay:
        rep = build_replay(replay_cfg, spec, run_dir=run_dir, seed=seed, device=device, train=train)
        if rep.demo is not None:
            log.warning(self.demos_ignored)
        rep.sampler = ChunkStartView(rep.buffer)
        return rep

    def make_learner(self, networks: NoiseSACNetworks, data: Replay, accelerator,
                     *, env_steps: Callable[[], int]) -> OffPolicyLearner:
        agent = self.agent_cls(self.cfg, networks.policy, networks.spec, accelerator, critic=networks.critic)
        return OffPolicyLearner(agent, data.sampler, batch_size=self.cfg.batch_size, env_steps=env_steps,
                                learning_starts=self.cfg.learning_starts,
                                max_update_ratio=self.cfg.max_update_ratio,
                                publish_every=self.cfg.publish_every, horizon=self.horizon(networks.policy))
