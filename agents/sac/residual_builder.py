"""Residual SAC's builder (``algo=sac_residual policy=openvla_oft`` or ``policy=mlp``, see
:mod:`agents.sac.residual`).

- the policy the learner trains and serves is :class:`agents.sac.residual_actor.ResidualPolicy`
  around the configured base, an OFT (L1 head) or an MLP (its mean chunk)
  (:meth:`ResidualSACBuilder.wrap_policy`; the registry calls it for the trained copy and the
  serving copy alike): what is served is clip(base(obs) + residual_scale * r), what is
  published is the residual actor alone;
- the data and cadence are noise-space SAC's (:class:`agents.sac.noise_builder.NoiseSACBuilder`):
  chunk windows that start at a chunk start, ``extra.residual`` the stored action.
  Demonstrations (``buffer.demos``) are not mixed in (their residual is unknown without the
  base's chunk at each of their chunk starts); they are ignored, with a warning.

Actors run whole chunks (``chunk.execute`` = 0 or ``algo.execute_steps``) in remote mode: a
local-mode actor builds the plain base and cannot load the residual actor's weights.
"""

from __future__ import annotations

from agents.sac.noise_builder import NoiseSACBuilder
from agents.sac.residual_actor import ResidualPolicy, check_residual_base
from agents.sac.residual import ResidualSACAgent, ResidualSACConfig, make_residual_critic


class ResidualSACBuilder(NoiseSACBuilder):
    name = "sac_residual"
    agent_cls = ResidualSACAgent
    demos_ignored = "residual SAC ignores buffer.demos: their residual to the base is unknown"
    cfg: ResidualSACConfig

    def check_policy_class(self, policy_name: str, cls) -> None:
        """Start-up check beyond the capability protocol: an L1 (continuous) head."""
        check_residual_base(policy_name, cls)

    def wrap_policy(self, policy) -> ResidualPolicy:
        """The residual policy around a freshly built base policy (idempotent)."""
        if isinstance(policy, ResidualPolicy):
            return policy
        c = self.cfg
        return ResidualPolicy(policy, residual_scale=c.residual_scale, hidden_dims=tuple(c.residual_actor_hidden_dims),
                              activation_name=c.critic_activation, init_std=c.residual_init_std)

    def make_critic(self, policy):
        return make_residual_critic(self.cfg, policy)
