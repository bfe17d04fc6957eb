"""Residual SAC (PLD / Policy Decorator style): SAC whose action is a bounded residual added to
a frozen base policy's action chunk: OpenVLA-OFT's L1 chunk (``algo=sac_residual
policy=openvla_oft``) or the MLP's deterministic chunk (``policy=mlp``; the OFT is described
below, the MLP's features are :func:`agents.sac.residual_actor.mean_chunk_features`).

The policy is a :class:`agents.sac.residual_actor.ResidualPolicy`: the frozen OFT (L1 head) gives
the base chunk a_base [H, A]; a tanh-Gaussian residual actor on (VLA features, a_base) gives
r in [-1, 1]^(H x A); the executed chunk is clip(a_base + residual_scale * r, -1, 1). One
transition is one executed chunk (a replay window of H steps starting at a chunk start), its
stored SAC action ``extra.residual`` [B, H, A] (``action`` holds the executed chunk). The
critic ensemble scores (features, r): the features hold a_base, so Q(s, r) is Q of the
executed chunk; the TD target is the chunk's discounted reward plus gamma^k (min Q_target(s',
r') - alpha log pi(r'|s')), r' ~ pi(.|s').

The update is noise-space SAC's, unchanged (:class:`agents.sac.noise.NoiseSACAgent`: the math
is identical with r in place of the noise): features of the frozen VLA once per distinct
observation (:class:`agents.sac.noise.FeatureCache`, ``noise_feature_cache`` rows) for the
obs and next obs of a batch in one forward, read by the critic (``CachedFeatures``) and the
actor alike; the VLA never runs twice per update for one batch and no gradient reaches it.
This module adds the residual's configuration, critic and agent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.base import Batch
from agents.common.critics import EnsembleCritic
from agents.sac.agent import SACConfig, sac_actor_step
from agents.sac.noise import CachedFeatures, FrozenBaseSACConfig, NoiseSACAgent
from agents.sac.residual_actor import RESIDUAL_EXTRA, ResidualPolicy


@dataclass
class ResidualSACConfig(FrozenBaseSACConfig):
    """``algo=sac_residual``: :class:`agents.sac.noise.FrozenBaseSACConfig` with the residual's
    keys (the SAC keys, ``execute_steps`` and ``noise_feature_cache`` keep their meaning)."""

    #: executed chunk = clip(base + residual_scale * r, -1, 1), r in [-1, 1]: the most any
    #: action may depart from the VLA's (in env action units)
    residual_scale: float = 0.3
    #: hidden widths of the residual actor (LayerNorm + ``critic_activation``)
    residual_actor_hidden_dims: tuple[int, ...] = (256, 256)
    #: the untrained actor's pre-tanh std (its mean residual is ~0: the base's chunk)
    residual_init_std: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.residual_scale <= 0 or self.residual_init_std <= 0:
            raise ValueError(f"residual_scale and residual_init_std must be > 0, got "
                             f"{self.residual_scale}, {self.residual_init_std}")

    @property
    def requires(self) -> tuple[type, ...]:
        """None of :data:`agents.base.CAPABILITIES`: the builder's ``check_policy_class``
        (:func:`agents.sac.residual_actor.check_residual_base`) checks the base at start-up."""
        return ()


def make_residual_critic(cfg: SACConfig, policy: ResidualPolicy) -> EnsembleCritic:
    """Q(features incl. the base chunk, residual) ensemble over the H * A residual values."""
    return EnsembleCritic(CachedFeatures(policy.feature_dim), policy.residual_actor.flat_dim,
                          num_critics=cfg.num_critics, hidden_dims=tuple(cfg.critic_hidden_dims),
                          layer_norm=cfg.critic_layer_norm, activation_name=cfg.critic_activation)


class ResidualSACAgent(NoiseSACAgent):
    """Noise-space SAC's agent over a :class:`ResidualPolicy`'s residual actor (module
    docstring); checkpoints carry ``action_space="residual"``."""

    policy_type = ResidualPolicy
    actor_attr = "residual_actor"
    action_space = "residual"

    def __init__(self, cfg: ResidualSACConfig, policy: ResidualPolicy, spec, accelerator,
                 critic: EnsembleCritic | None = None):
        if isinstance(policy, ResidualPolicy) and critic is None:
            critic = make_residual_critic(cfg, policy)
        super().__init__(cfg, policy, spec, accelerator, critic=critic)

    def stored_noise(self, batch: Batch) -> torch.Tensor:
        """The SAC action of each row: ``extra.residual`` [B, H, A]."""
        return batch["extra." + RESIDUAL_EXTRA].float()

    def actor_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        metrics, r = sac_actor_step(self, batch)
        metrics["residual_abs_mean"] = r.detach().abs().mean()
        return metrics
