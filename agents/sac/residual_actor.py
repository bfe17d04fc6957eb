"""Residual policy (PLD / Policy Decorator style): a frozen base policy gives the base chunk, a
small tanh-Gaussian residual actor adds a bounded correction to it. Two kinds of base:

- an OpenVLA-OFT with its L1 head (:class:`L1ChunkPolicy`, features :func:`oft_features`);
- a tanh-Gaussian chunk policy whose mean is a head over its own observation encoder
  (:class:`MeanChunkPolicy`, the MLP; features :func:`mean_chunk_features`): the base chunk
  is its deterministic action tanh(mean).

Shapes (B = batch, H = chunk size, A = action dim, D = the VLA's width, S = state dim):

    oft_features(policy, obs)         float32 [B, D + S + H*A]   frozen, no gradient, ONE VLA
                                      forward: layer-normed mean of the K = H*A action-position
                                      hidden states | the normalised state | the base chunk
                                      (env units, what the L1 head serves), flattened
    mean_chunk_features(policy, obs)  float32 [B, E + H*A]   frozen, no gradient, one encoder
                                      forward: the policy's own features [B, E] | its
                                      deterministic chunk tanh(mean), flattened
    ResidualPolicy.actor.sample(f)    (r [B, H, A] in [-1, 1], log_prob [B])  reparameterised
    ResidualPolicy.act(obs).actions   [B, H, A] = clip(base + residual_scale * r, -1, 1)
    ResidualPolicy.act(obs).extras    residual [B, H, A]: r (the SAC action the replay stores)

The features include the base chunk, so the residual actor (and the critic, which reads the
same features) sees what the VLA would do; one frozen forward yields both the features and
the base chunk, in serving and in training (where :class:`agents.sac.noise.FeatureCache`
keeps them per distinct observation). The untrained actor's mean residual is ~0, so its
deterministic chunk is the base's; ``residual_scale`` bounds how far any chunk departs from
the base (per action dim, before the clip to the [-1, 1] action range).

The residual actor is :class:`agents.sac.noise_actor.NoiseActor` with scale 1: the same
tanh-Gaussian chunk head over features (DSRL's noise actor), here over residuals.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch, ExtrasSpec, has_capability
from agents.sac.noise_actor import NoiseActor, _sub_obs
from data.core.schema import OBS_STATE

RESIDUAL_EXTRA = "residual"
_PREFIX = "residual_actor."


@runtime_checkable
class L1ChunkPolicy(Protocol):
    """A VLA whose frozen forward gives the action positions' hidden states (``model_inputs``,
    ``hidden``) and a continuous regression head over them (OpenVLA-OFT's L1 head,
    ``head_kind == "l1"``): what a residual actor is added to."""

    def model_inputs(self, obs: Batch) -> tuple: ...

    def hidden(self, inputs: tuple) -> torch.Tensor: ...


@runtime_checkable
class MeanChunkPolicy(Protocol):
    """A tanh-Gaussian chunk policy whose pre-tanh mean is a head over its own observation
    features (``features``, ``dist_params_from_features``; the MLP): its deterministic chunk
    tanh(mean) is the base chunk a residual is added to."""

    @property
    def feature_dim(self) -> int: ...

    def features(self, obs: Batch, prefix: str = "") -> torch.Tensor: ...

    def dist_params_from_features(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def check_residual_base(policy_name: str, cls_or_policy) -> None:
    """Start-up check of a residual base (on the class, before a model is built): an
    :class:`L1ChunkPolicy` whose head is the continuous L1 one (the discrete OFT samples
    action tokens; a residual on them is not what this algorithm does), or a
    :class:`MeanChunkPolicy`."""
    cls = cls_or_policy if isinstance(cls_or_policy, type) else type(cls_or_policy)
    if not has_capability(cls, L1ChunkPolicy):
        if has_capability(cls, MeanChunkPolicy):
            return
        raise ValueError(f"algorithm 'sac_residual' cannot train policy {policy_name!r}: the policy "
                         f"provides neither L1ChunkPolicy (model_inputs, hidden: a VLA's action-position hidden "
                         f"states, and an L1 action head) nor MeanChunkPolicy (features, "
                         f"dist_params_from_features: a tanh-Gaussian head over its own features); "
                         f"use policy=openvla_oft or policy=mlp")
    kind = getattr(cls, "head_kind", None)
    if kind != "l1":
        raise ValueError(f"algorithm 'sac_residual' cannot train policy {policy_name!r}: the "
                         f"residual is added to a continuous L1-head chunk (policy=openvla_oft, action_head=l1); "
                         f"{policy_name!r} has head_kind={kind!r}")


@torch.no_grad()
def oft_features(policy, obs: Batch, prefix: str = "") -> torch.Tensor:
    """[B, D + S + H*A] float32 of a frozen OFT L1 policy (the module docstring): one forward."""
    o = _sub_obs(obs, prefix)
    inputs = policy.model_inputs(o)
    h = policy.hidden(inputs)
    head = policy.action_head
    base = policy._finish(head.predict_action(h.to(head.model.fc1.weight.dtype)))  # noqa: SLF001 - OFT's own un-normalise + clip
    pooled = h.float().mean(1)
    state = policy._normalize(o[OBS_STATE].to(policy.device).float(), "proprio")  # noqa: SLF001
    return torch.cat([F.layer_norm(pooled, pooled.shape[-1:]), state, base.flatten(1).float()], dim=-1)


@torch.no_grad()
def mean_chunk_features(policy, obs: Batch, prefix: str = "") -> torch.Tensor:
    """[B, E + H*A] float32 of a frozen :class:`MeanChunkPolicy` (the module docstring): its
    features and its deterministic chunk, from one encoder forward."""
    o = {k: v.to(policy.device) if torch.is_tensor(v) else v for k, v in _sub_obs(obs, prefix).items()}
    f = policy.features(o).float()
    mean, _ = policy.dist_params_from_features(f)
    return torch.cat([f, torch.tanh(mean).float().flatten(1)], dim=-1)


class ResidualPolicy(nn.Module):
    """A frozen base (an OFT L1 policy or a :class:`MeanChunkPolicy`) plus a residual actor
    (module docstring). Only
    ``residual_actor`` trains and is synced (``trainable_state_dict``); the base stays frozen
    in eval mode. ``act(obs, deterministic=True)`` adds the actor's mean residual."""

    def __init__(self, base, *, residual_scale: float = 0.3, hidden_dims=(256, 256), layer_norm: bool = True,
                 activation_name: str = "relu", init_std: float = 1.0):
        super().__init__()
        if residual_scale <= 0:
            raise ValueError(f"residual_scale must be > 0, got {residual_scale}")
        check_residual_base(type(base).__name__, base)
        self.base = base
        base.requires_grad_(False)
        base.eval()
        self.residual_scale = float(residual_scale)
        self.chunk_size, self.action_dim = int(base.chunk_size), int(base.action_dim)
        self.base_dim = self.chunk_size * self.action_dim
        if has_capability(base, L1ChunkPolicy):
            self._features = oft_features
            self.feature_dim = int(base.model.llm_dim) + int(base.spec.state_dim) + self.base_dim
        else:
            self._features = mean_chunk_features
            self.feature_dim = int(base.feature_dim) + self.base_dim
        self.residual_actor = NoiseActor(self.feature_dim, self.chunk_size, self.action_dim,
                                         hidden_dims=hidden_dims, scale=1.0, layer_norm=layer_norm,
                                         activation_name=activation_name, init_std=init_std)
        self.residual_actor.to(base.device)

    @property
    def device(self) -> torch.device:
        return self.residual_actor.head.weight.device

    def train(self, mode: bool = True):
        super().train(mode)
        self.base.eval()  # frozen: never in training mode
        return self

    def features(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        """Frozen features [B, F], the base chunk in their last H*A values (:func:`oft_features`
        or :func:`mean_chunk_features`)."""
        return self._features(self.base, obs, prefix)

    def base_chunk(self, feats: torch.Tensor) -> torch.Tensor:
        """The base chunk [B, H, A] inside features [B, F]."""
        return feats[:, -self.base_dim:].view(-1, self.chunk_size, self.action_dim)

    def executed(self, base: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """clip(base + residual_scale * residual, -1, 1): the chunk the robot runs."""
        return (base + self.residual_scale * residual).clamp(-1.0, 1.0)

    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """The base chunk plus the actor's residual (drawn from ``generator`` when given, else
        torch's global RNG; its mean when deterministic); the frozen base draws nothing."""
        feats = self.features(obs).to(self.device)
        a = self.residual_actor
        r = a.mean_noise(feats) if deterministic else a.sample(feats, generator)[0]
        return ActionChunk(self.executed(self.base_chunk(feats), r), None, {RESIDUAL_EXTRA: r.float()})

    def extras_spec(self) -> ExtrasSpec:
        return {RESIDUAL_EXTRA: ("float32", (self.chunk_size, self.action_dim))}

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The residual actor's tensors only (detached CPU copies)."""
        return {_PREFIX + k: v.detach().to("cpu", copy=True) for k, v in self.residual_actor.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = {k[len(_PREFIX):]: v for k, v in state.items() if k.startswith(_PREFIX)}
        extra = sorted(k for k in state if not k.startswith(_PREFIX))
        if extra:
            raise ValueError(f"residual policy: unexpected weights {extra[:5]} (only {_PREFIX}* are synced)")
        self.residual_actor.load_state_dict(own, strict=True)
