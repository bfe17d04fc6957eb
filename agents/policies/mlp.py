"""Small MLP (+ CNN for cameras) tanh-Gaussian policy.

This is the laptop-class policy: a newcomer trains it on CPU on a cheap simulated task,
and the same code path (``Policy`` protocol, batch layout of :mod:`agents.base`) carries
the large VLA policies.

Shapes (B = batch, S = state dim, A = action dim, H = ``chunk_size``, E = ensemble size):

    obs["observation.state"]          float32 [B, S]
    obs["observation.images.<cam>"]   uint8   [B, Hi, Wi, 3]   (one per camera of the spec)
    MLPPolicy.features(obs)           float32 [B, D]   (its observation encoder)
    MLPPolicy.act(obs).actions        float32 [B, H, A] in [-1, 1]
    MLPPolicy.act(obs).extras         log_prob [B], noise [B, H, A] (the Gaussian draw)
    MLPPolicy.sample(obs)             ([B, H, A], [B])  reparameterised
    MLPPolicy.log_prob(obs, actions)  [B]      (actions [B, A] or [B, H, A])

Capabilities (:mod:`agents.base`): BCPolicy, LogProbPolicy, ReparamSampler, FeaturePolicy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from agents.base import ActionChunk, Batch, ExtrasSpec
from agents.common.encoders import EncoderConfig, ObsEncoder, activation
from agents.common.squash import tanh_log_det
from data.core.spec import DEFAULT_FLOAT_RANGE, EnvSpec


@dataclass
class MLPPolicyConfig(EncoderConfig):
    """Architecture of :class:`MLPPolicy`: the observation encoder's fields (inherited from
    :class:`agents.common.encoders.EncoderConfig`) and the actor's."""

    #: widths of the actor's hidden layers (after the observation encoder)
    hidden_dims: tuple[int, ...] = (256, 256)
    #: lower bound of the Gaussian's log standard deviation (pre-tanh)
    log_std_min: float = -5.0
    #: upper bound of the Gaussian's log standard deviation (pre-tanh)
    log_std_max: float = 2.0
    #: actions per policy query (1 = one action per step; >1 outputs an action chunk)
    chunk_size: int = 1
    #: LayerNorm after each hidden layer of the actor MLP
    actor_layer_norm: bool = False
    #: activation of all hidden layers: "relu", "elu", "gelu" or "silu"
    activation: str = "relu"
    #: clamp for actions inside atanh in ``log_prob`` / ``bc_loss`` (|a| <= 1 - eps)
    atanh_eps: float = 1e-6


class MLPPolicy(nn.Module):
    """Tanh-squashed diagonal Gaussian over ``chunk_size * A`` action dims.

    Implements the :class:`agents.base.Policy` protocol plus ``sample`` (reparameterised),
    ``log_prob``, ``bc_loss`` and ``features``.
    """

    def __init__(self, cfg: MLPPolicyConfig, spec: EnvSpec):
        super().__init__()
        if cfg.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {cfg.chunk_size}")
        self.cfg = cfg
        self.spec = spec
        self.chunk_size = int(cfg.chunk_size)
        self.action_dim = spec.action_dim
        self.encoder = ObsEncoder(spec, cfg)
        layers: list[nn.Module] = []
        d = self.encoder.out_dim
        for h in cfg.hidden_dims:
            layers.append(nn.Linear(d, h))
            if cfg.actor_layer_norm:
                layers.append(nn.LayerNorm(h))
            layers.append(activation(cfg.activation))
            d = h
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(d, 2 * self.flat_action_dim)

    @property
    def flat_action_dim(self) -> int:
        return self.chunk_size * self.action_dim

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    # -- distribution ---------------------------------------------------------------------
    def dist_params(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh mean and log-std, each [B, H*A]. ``prefix="next."`` reads next obs."""
        return self.dist_params_from_features(self.encoder(obs, prefix))

    def dist_params_from_features(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh mean and log-std [B, H*A] from encoder features [B, feature_dim]."""
        h = self.trunk(feats)
        mean, log_std = self.head(h).chunk(2, dim=-1)
        lo, hi = self.cfg.log_std_min, self.cfg.log_std_max
        log_std = lo + 0.5 * (hi - lo) * (torch.tanh(log_std) + 1.0)
        return mean, log_std

    def _draw(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(actions [B, H*A], log_prob [B], the standard-normal draw [B, H*A])."""
        return self._draw_params(*self.dist_params(obs, prefix))

    def _draw_params(self, mean: torch.Tensor, log_std: torch.Tensor, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)  # None: global RNG
        u = mean + log_std.exp() * eps
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)).sum(-1)
        return torch.tanh(u), logp, eps

    def sample_flat(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample, flat: (actions [B, H*A], log_prob [B])."""
        a, logp, _ = self._draw(obs, prefix)
        return a, logp

    def sample(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample: (actions [B, H, A], log_prob [B])."""
        a, logp = self.sample_flat(obs, prefix)
        return a.view(a.shape[0], self.chunk_size, self.action_dim), logp

    def sample_from_features(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample from encoder features [B, feature_dim] (e.g. a critic's
        detached features of the same encoder, SAC's ``critic_encoder=shared``):
        (actions [B, H, A], log_prob [B])."""
        a, logp, _ = self._draw_params(*self.dist_params_from_features(feats))
        return a.view(a.shape[0], self.chunk_size, self.action_dim), logp

    @property
    def feature_dim(self) -> int:
        return int(self.encoder.out_dim)

    def features(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        """The policy's observation encoding [B, feature_dim]."""
        return self.encoder(obs, prefix)

    def log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """Log density [B] of ``actions`` ([B, A] or [B, H, A], in [-1, 1]) under the policy."""
        return self._log_prob_params(*self.dist_params(obs), actions)

    def _log_prob_params(self, mean: torch.Tensor, log_std: torch.Tensor,
                         actions: torch.Tensor) -> torch.Tensor:
        """Log density [B] of ``actions`` as stored (squashed; clamped to |a| <= 1 - atanh_eps,
        then mapped back through atanh)."""
        eps_a = self.cfg.atanh_eps
        a = actions.reshape(actions.shape[0], -1).to(mean.dtype).clamp(-1 + eps_a, 1 - eps_a)
        u = torch.atanh(a)
        z = (u - mean) / log_std.exp()
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)).sum(-1)

    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """Behaviour cloning: mean negative log-likelihood of ``batch["action"]``."""
        return -self.log_prob(batch, batch["action"]).mean()

    # -- Policy protocol --------------------------------------------------------------------
    def extras_spec(self) -> ExtrasSpec:
        """``log_prob`` of the returned chunk and ``noise``, the standard-normal draw that
        produced it (zeros for the deterministic mean)."""
        return {"log_prob": ("float32", ()),
                "noise": ("float32", (self.chunk_size, self.action_dim))}

    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """Actions [B, H, A] float32 in [-1, 1]; log_prob [B] of those actions; extras
        ``noise`` [B, H, A] (zeros when deterministic: the mean action), drawn from
        ``generator`` when given (else torch's global RNG).

        ``log_prob`` is that of the float32 actions returned, computed as :meth:`log_prob`
        computes it (an update recomputes it for the importance weights): where tanh rounds a
        pre-tanh draw to +-1 (|u| > ~9), :meth:`log_prob` sees atanh of the clamped action
        (~7.25), far from the draw's own density, and such chunks got importance weights ~0.
        Far enough out (a mean of +-20 at the smallest std) that log-prob leaves the wire's
        float range; it is stored at the range's floor (:data:`DEFAULT_FLOAT_RANGE`), which
        ingest accepts, and such a chunk's importance weight is ~0 either way."""
        mean, log_std = self.dist_params(obs)
        if deterministic:
            eps = torch.zeros_like(mean)
            a = torch.tanh(mean)
        else:
            a, _, eps = self._draw_params(mean, log_std, generator)
        a = a.float()
        logp = self._log_prob_params(mean.float(), log_std.float(), a).clamp(min=DEFAULT_FLOAT_RANGE[0])
        shape = (a.shape[0], self.chunk_size, self.action_dim)
        return ActionChunk(a.view(shape), logp.float(), {"noise": eps.float().view(shape)})

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """All the actor's tensors, detached clones on CPU (this is what actors receive)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state, strict=True)


