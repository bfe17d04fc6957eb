"""Q-function ensembles an algorithm builds for any policy.

A critic reads observation features from an *encoder* (a module ``encoder(obs, prefix)
-> [B, D]`` with ``out_dim``): either its own :class:`agents.common.encoders.ObsEncoder` (trained by
the critic loss; the usual choice for small policies and pixels) or :class:`PolicyFeatures`,
the frozen features of a :class:`agents.base.FeaturePolicy` (a VLA's backbone, so a critic
for a 3B-parameter policy is a small head). Shapes (E = ensemble size):

    EnsembleCritic(obs, actions)      float32 [E, B]   actions [B, A] / [B, H, A] / [B, H*A]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import Batch
from agents.common.encoders import EncoderConfig, ObsEncoder, activation


class _Ref:
    """A reference that ``copy.deepcopy`` (target networks) and ``nn.Module`` leave alone."""

    def __init__(self, obj):
        self.obj = obj

    def __deepcopy__(self, memo):
        return self


class PolicyFeatures(nn.Module):
    """A policy's observation features as a frozen critic encoder (no gradient flows into the
    policy). The policy is held by reference, not registered as a submodule, so it is
    neither copied into target critics nor saved with the critic."""

    def __init__(self, policy):
        super().__init__()
        self._policy = _Ref(policy)
        self.out_dim = int(policy.feature_dim)

    def forward(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        with torch.no_grad():
            return self._policy.obj.features(obs, prefix).float()


class EnsembleLinear(nn.Module):
    """E independent linear layers applied in one batched matmul: [E, B, in] -> [E, B, out]."""

    def __init__(self, ensemble: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ensemble, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(ensemble, 1, out_dim))
        bound = 1.0 / math.sqrt(in_dim)  # nn.Linear's default init, per member
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    """LayerNorm over the last dim with per-member affine parameters: [E, B, D]."""

    def __init__(self, ensemble: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ensemble, 1, dim))
        self.bias = nn.Parameter(torch.zeros(ensemble, 1, dim))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,)) * self.weight + self.bias


class EnsembleCritic(nn.Module):
    """E Q-functions Q_i(s, a) -> [E, B] over one observation encoder shared by the members.

    ``action_dim`` is the flat size of the actions scored: ``chunk_size * A`` for a critic
    over whole action chunks (Q-chunking), ``A`` for per-step actions.
    """

    def __init__(self, encoder: nn.Module, action_dim: int, *, num_critics: int = 2,
                 hidden_dims: tuple[int, ...] = (256, 256), layer_norm: bool = True,
                 activation_name: str = "relu"):
        super().__init__()
        if num_critics < 1:
            raise ValueError(f"num_critics must be >= 1, got {num_critics}")
        self.num_critics = int(num_critics)
        self.action_dim = int(action_dim)
        self.encoder = encoder
        layers: list[nn.Module] = []
        d = int(encoder.out_dim) + self.action_dim
        for h in hidden_dims:
            layers.append(EnsembleLinear(num_critics, d, h))
            if layer_norm:
                layers.append(EnsembleLayerNorm(num_critics, h))
            layers.append(activation(activation_name))
            d = h
        layers.append(EnsembleLinear(num_critics, d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Batch, actions: torch.Tensor, prefix: str = "") -> torch.Tensor:
        """Q-values [E, B] for ``actions`` [B, A] / [B, H, A] / [B, H*A]."""
        return self.q(self.encoder(obs, prefix), actions)

    def q(self, feats: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Q-values [E, B] from encoder features [B, D] (the encoder already run)."""
        flat = actions.reshape(actions.shape[0], -1).to(feats.dtype)
        if flat.shape[1] != self.action_dim:
            raise ValueError(f"critic scores actions of {self.action_dim} values, got "
                             f"{tuple(actions.shape)}")
        x = torch.cat([feats, flat], dim=-1)
        x = x.unsqueeze(0).expand(self.num_critics, *x.shape)
        return self.net(x).squeeze(-1)


def make_critic(cfg, spec, policy) -> EnsembleCritic:
    """SAC's critic ensemble (``cfg``: :class:`agents.sac.agent.SACConfig`) for ``policy``: over its
    own encoder or the policy's features (``cfg.critic_encoder``), scoring whole chunks of
    ``policy.chunk_size`` actions."""
    if cfg.critic_encoder == "policy":
        encoder: nn.Module = PolicyFeatures(policy)
    elif cfg.critic_encoder == "shared":
        encoder = getattr(policy, "encoder", None)
        if not isinstance(encoder, nn.Module) or not hasattr(policy, "sample_from_features"):
            raise ValueError(f"critic_encoder=shared needs a policy with an `encoder` module and "
                             f"`sample_from_features` (e.g. mlp); {type(policy).__name__} has not")
    else:
        encoder = ObsEncoder(spec, EncoderConfig(cnn_channels=tuple(cfg.critic_cnn_channels),
                                                 image_embed_dim=cfg.critic_image_embed_dim,
                                                 state_embed_dim=cfg.critic_state_embed_dim,
                                                 image_encoder=cfg.critic_image_encoder))
    chunk = int(getattr(policy, "chunk_size", 1))
    return EnsembleCritic(encoder, chunk * spec.action_dim, num_critics=cfg.num_critics,
                          hidden_dims=tuple(cfg.critic_hidden_dims),
                          layer_norm=cfg.critic_layer_norm, activation_name=cfg.critic_activation)
