"""Noise-space policy (DSRL): a small tanh-Gaussian actor picks the initial noise of a frozen
flow policy's denoising ODE, and the flow policy turns that noise into the executed chunk.

Shapes (B = batch, H = chunk size, D = the flow's noise width per step, PI0's
``max_action_dim``; d = the noise dims the actor controls, ``action_dim`` or D):

    pi0_features(policy, obs)            float32 [B, F]   frozen, no gradient
    NoiseActor.sample(features)          (noise [B, H, d], log_prob [B])  reparameterised
    NoiseActor.mean_noise(features)      [B, H, d]   noise_scale * tanh(mean)
    NoiseSpacePolicy.act(obs).actions    [B, H, A]   = PI0(obs, noise)
    NoiseSpacePolicy.act(obs).extras     noise [B, H, D]: the full noise PI0 started from
                                         (the actor's d dims, zeros in the others)

The features (:func:`pi0_features`) are the frozen model's prefix embeddings (PI0's own
``embed_prefix``: SigLIP tokens of each camera and the instruction's token embeddings), each
segment mean-pooled and layer-normalised, plus the normalised state. They come from PI0's
public methods (``model_inputs``, ``inner.model.embed_prefix``, ``norm``): pi0.py has no
feature hook. In serving, ``act`` embeds the prefix twice (once for the features, once
inside PI0's ``sample_actions``); training never does (features are computed once per
batch, :mod:`agents.sac.noise`).

:class:`NoiseSpacePolicy` is what the learner trains and serves: its
``trainable_state_dict`` is the noise actor alone (the frozen PI0 weights are already on
every copy), and its extras are PI0's (``noise``), so the actor side needs nothing new.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch, ExtrasSpec
from agents.common.encoders import activation
from agents.common.squash import tanh_log_det
from data.core.schema import OBS_STATE

NOISE_EXTRA = "noise"
_PREFIX = "noise_actor."


def _sub_obs(obs: Batch, prefix: str) -> Batch:
    """The observation keys under ``prefix`` (``"next."``) without it, plus ``task``."""
    if not prefix:
        return obs
    out = {k[len(prefix):]: v for k, v in obs.items() if k.startswith(prefix + "observation.")}
    if "task" in obs:
        out["task"] = obs["task"]
    return out


@torch.no_grad()
def pi0_features(policy, obs: Batch, prefix: str = "") -> torch.Tensor:
    """Frozen observation features [B, F] of a PI0/PI0.5 policy (see the module docstring):
    per camera and for the instruction, the masked mean of PI0's prefix embeddings, layer-
    normalised; then the normalised state. One prefix embedding (the vision tower and the
    token embeddings), no language-model pass."""
    o = _sub_obs(obs, prefix)
    inputs = policy.model_inputs(o)
    images, img_masks, toks, tok_masks = inputs[:4]
    embs, _, _ = policy.inner.model.embed_prefix(images, img_masks, toks, tok_masks)
    embs = embs.float()
    n_lang = toks.shape[1]
    per_img = (embs.shape[1] - n_lang) // max(len(images), 1)
    parts = []
    for i, m in enumerate(img_masks):
        seg = embs[:, i * per_img:(i + 1) * per_img].mean(1)
        parts.append(F.layer_norm(seg, seg.shape[-1:]) * m.to(seg.dtype)[:, None])
    lang = embs[:, embs.shape[1] - n_lang:]
    w = tok_masks.to(lang.dtype)[..., None]
    seg = (lang * w).sum(1) / w.sum(1).clamp_min(1.0)
    parts.append(F.layer_norm(seg, seg.shape[-1:]))
    state = o[OBS_STATE].to(embs.device).float()
    parts.append(policy.norm(state, OBS_STATE))
    return torch.cat(parts, dim=-1)


def pi0_feature_dim(policy) -> int:
    """F of :func:`pi0_features` without running the model."""
    width = int(policy.inner.model.paligemma_with_expert.paligemma.config.text_config.hidden_size)
    n_img = len(policy.lr_cfg.image_features)
    return (n_img + 1) * width + int(policy.spec.state_dim)


class NoiseActor(nn.Module):
    """Tanh-Gaussian over the noise: noise = ``scale`` * tanh(u), u ~ N(mean(f), std(f)^2),
    from features f [B, F] to [B, H, d] (the MLP policy's parameterisation)."""

    def __init__(self, feature_dim: int, horizon: int, dims: int, *, hidden_dims=(256, 256),
                 scale: float = 1.0, layer_norm: bool = True, activation_name: str = "relu",
                 log_std_min: float = -5.0, log_std_max: float = 2.0, init_std: float = 1.0):
        super().__init__()
        if scale <= 0:
            raise ValueError(f"noise scale must be > 0, got {scale}")
        self.horizon, self.dims, self.scale = int(horizon), int(dims), float(scale)
        self.log_std_min, self.log_std_max = float(log_std_min), float(log_std_max)
        layers: list[nn.Module] = []
        d = int(feature_dim)
        for h in hidden_dims:
            layers += [nn.Linear(d, h)] + ([nn.LayerNorm(h)] if layer_norm else []) + [activation(activation_name)]
            d = h
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(d, 2 * self.flat_dim)
        # start near the flow's own prior: u ~ N(0, init_std^2) whatever the features (small
        # weights, log-std bias at init_std), so the untrained actor explores like the base
        with torch.no_grad():
            self.head.weight.mul_(0.01)
            self.head.bias.zero_()
            t = 2.0 * (math.log(init_std) - log_std_min) / (log_std_max - log_std_min) - 1.0
            self.head.bias[self.flat_dim:] = math.atanh(max(-0.999, min(0.999, t)))

    @property
    def flat_dim(self) -> int:
        return self.horizon * self.dims

    def dist_params(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh mean and log-std, each [B, H*d]."""
        mean, log_std = self.head(self.trunk(feats)).chunk(2, dim=-1)
        lo, hi = self.log_std_min, self.log_std_max
        return mean, lo + 0.5 * (hi - lo) * (torch.tanh(log_std) + 1.0)

    def sample(self, feats: torch.Tensor, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised (noise [B, H, d], log_prob [B]) (density of the scaled noise); the
        standard normals from ``generator`` when given, else torch's global RNG."""
        mean, log_std = self.dist_params(feats)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)  # None: global RNG
        u = mean + log_std.exp() * eps
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)
                - math.log(self.scale)).sum(-1)
        return (self.scale * torch.tanh(u)).view(-1, self.horizon, self.dims), logp

    def mean_noise(self, feats: torch.Tensor) -> torch.Tensor:
        mean, _ = self.dist_params(feats)
        return (self.scale * torch.tanh(mean)).view(-1, self.horizon, self.dims)


class NoiseSpacePolicy(nn.Module):
    """A frozen noise-conditioned flow policy (``base``, PI0) driven by a :class:`NoiseActor`.

    ``act(obs)`` = base.act(obs, noise = actor(features(obs))) with the full noise as the
    ``noise`` extra; deterministic: the actor's mean noise. Only ``noise_actor`` trains and
    is synced (``trainable_state_dict``); the base stays frozen in eval mode.
    """

    def __init__(self, base, *, noise_dims: str = "action", scale: float = 1.0,
                 hidden_dims=(256, 256), layer_norm: bool = True, activation_name: str = "relu"):
        super().__init__()
        if noise_dims not in ("action", "all"):
            raise ValueError(f"noise_dims must be 'action' or 'all', got {noise_dims!r}")
        self.base = base
        base.requires_grad_(False)
        base.eval()
        self.chunk_size = int(base.chunk_size)
        self.action_dim = int(base.action_dim)
        self.full_dims = int(base.extras_spec()[NOISE_EXTRA][1][-1])
        self.dims = self.action_dim if noise_dims == "action" else self.full_dims
        self.feature_dim = pi0_feature_dim(base)
        self.noise_actor = NoiseActor(self.feature_dim, self.chunk_size, self.dims, hidden_dims=hidden_dims,
                                      scale=scale, layer_norm=layer_norm, activation_name=activation_name)
        self.noise_actor.to(base.device)

    @property
    def device(self) -> torch.device:
        return self.noise_actor.head.weight.device

    def train(self, mode: bool = True):
        super().train(mode)
        self.base.eval()  # frozen: never in training mode
        return self

    def features(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        """Frozen features [B, F] (:func:`pi0_features`)."""
        return pi0_features(self.base, obs, prefix)

    def full_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """The actor's [B, H, d] noise as the flow's [B, H, D] (zeros past d)."""
        return F.pad(noise, (0, self.full_dims - noise.shape[-1]))

    def actor_noise(self, full: torch.Tensor) -> torch.Tensor:
        """The actor's dims [B, H, d] of a stored full noise [B, H, D] (``extra.noise``)."""
        return full[..., :self.dims]

    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """The actor's noise (drawn from ``generator`` when given, else torch's global RNG;
        its mean when deterministic) through the base, which gets ``generator`` too (plain PI0
        draws nothing more; a Flow-RL base draws its step noise)."""
        feats = self.features(obs).to(self.device)
        noise = self.noise_actor.mean_noise(feats) if deterministic else self.noise_actor.sample(feats, generator)[0]
        full = self.full_noise(noise)
        chunk = self.base.act(obs, noise=full, **({} if generator is None else {"generator": generator}))
        return ActionChunk(chunk.actions, None, {NOISE_EXTRA: full.float()})

    def extras_spec(self) -> ExtrasSpec:
        return dict(self.base.extras_spec())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The noise actor's tensors only (detached CPU copies)."""
        return {_PREFIX + k: v.detach().to("cpu", copy=True) for k, v in self.noise_actor.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = {k[len(_PREFIX):]: v for k, v in state.items() if k.startswith(_PREFIX)}
        extra = sorted(k for k in state if not k.startswith(_PREFIX))
        if extra:
            raise ValueError(f"noise-space policy: unexpected weights {extra[:5]} (only {_PREFIX}* are synced)")
        self.noise_actor.load_state_dict(own, strict=True)
