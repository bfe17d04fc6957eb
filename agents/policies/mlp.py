"""Small MLP (+ CNN for cameras) tanh-Gaussian policy and an ensemble Q critic.

This is the laptop-class policy: a newcomer trains it on CPU on a cheap simulated task,
and the same code path (``Policy`` protocol, batch layout of :mod:`agents.base`) carries
the large VLA policies.

Shapes (B = batch, S = state dim, A = action dim, H = ``chunk_size``, E = ensemble size):

    obs["observation.state"]          float32 [B, S]
    obs["observation.images.<cam>"]   uint8   [B, Hi, Wi, 3]   (one per camera of the spec)
    ObsEncoder(obs)                   float32 [B, D]
    MLPPolicy.act(obs).actions        float32 [B, H, A] in [-1, 1]
    MLPPolicy.sample(obs)             ([B, A] or [B, H, A] if H > 1,  [B])
    MLPPolicy.log_prob(obs, actions)  [B]      (actions [B, A] or [B, H, A])
    EnsembleCritic(obs, actions)      float32 [E, B]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.core.spec import EnvSpec

_LOG2 = math.log(2.0)


@dataclass
class MLPPolicyConfig:
    """Architecture of :class:`MLPPolicy` (the encoder fields also shape an
    :class:`EnsembleCritic`'s own encoder when an algorithm builds one from this config)."""

    #: widths of the actor's hidden layers (after the observation encoder)
    hidden_dims: tuple[int, ...] = (256, 256)
    #: output channels of the conv layers of the per-camera CNN (3x3 kernels; the first
    #: layer has stride 2, the others stride 1, DrQ-style); unused without cameras
    cnn_channels: tuple[int, ...] = (32, 32, 32, 32)
    #: size of each camera's embedding (linear + LayerNorm + tanh after the CNN)
    image_embed_dim: int = 50
    #: hidden width of the state MLP used when there are cameras (0: feed the raw state);
    #: without cameras the raw state goes straight to the actor/critic MLP
    state_embed_dim: int = 64
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


_ACTS = {"relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}


def _act(name: str) -> nn.Module:
    try:
        return _ACTS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(_ACTS)}") from None


class ImageEncoder(nn.Module):
    """uint8 [B, H, W, 3] -> float32 [B, embed_dim]: small conv stack, linear, LN, tanh."""

    def __init__(self, shape: tuple[int, int, int], channels: tuple[int, ...], embed_dim: int):
        super().__init__()
        h, w, c = shape
        if c != 3:
            raise ValueError(f"images must be [H, W, 3], got {shape}")
        convs: list[nn.Module] = []
        cin = c
        for i, cout in enumerate(channels):
            convs += [nn.Conv2d(cin, cout, 3, stride=2 if i == 0 else 1), nn.ReLU()]
            cin = cout
        self.convs = nn.Sequential(*convs, nn.Flatten())
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, c, h, w)).shape[1]
        self.head = nn.Sequential(nn.Linear(flat, embed_dim), nn.LayerNorm(embed_dim), nn.Tanh())

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = img.permute(0, 3, 1, 2).float().div(255.0) - 0.5
        return self.head(self.convs(x))


class ObsEncoder(nn.Module):
    """Observation dict -> flat features [B, out_dim].

    State-only specs: the raw state (identity). With cameras: one :class:`ImageEncoder` per
    camera (sorted by name) and a state MLP, concatenated.
    """

    def __init__(self, spec: EnvSpec, cfg: MLPPolicyConfig):
        super().__init__()
        self.image_keys = spec.image_keys
        self.cams = nn.ModuleDict({
            str(i): ImageEncoder(spec.cameras[k[len(OBS_IMAGE_PREFIX):]], cfg.cnn_channels,
                            cfg.image_embed_dim)
            for i, k in enumerate(self.image_keys)
        })
        if self.image_keys and cfg.state_embed_dim > 0:
            self.state = nn.Sequential(nn.Linear(spec.state_dim, cfg.state_embed_dim),
                                       nn.LayerNorm(cfg.state_embed_dim), nn.Tanh())
            state_out = cfg.state_embed_dim
        else:
            self.state = nn.Identity()
            state_out = spec.state_dim
        self.out_dim = state_out + len(self.image_keys) * cfg.image_embed_dim

    def forward(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        feats = [self.state(obs[prefix + OBS_STATE].float())]
        for i, k in enumerate(self.image_keys):
            feats.append(self.cams[str(i)](obs[prefix + k]))
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)


def tanh_log_det(u: torch.Tensor) -> torch.Tensor:
    """log(1 - tanh(u)^2), elementwise and numerically stable."""
    return 2.0 * (_LOG2 - u - F.softplus(-2.0 * u))


class MLPPolicy(nn.Module):
    """Tanh-squashed diagonal Gaussian over ``chunk_size * A`` action dims.

    Implements the :class:`agents.base.Policy` protocol plus ``sample`` (reparameterised),
    ``log_prob`` and ``bc_loss``.
    """

    capabilities = frozenset({"reparam_sample", "log_prob", "bc_loss"})

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
            layers.append(_act(cfg.activation))
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
        h = self.trunk(self.encoder(obs, prefix))
        mean, log_std = self.head(h).chunk(2, dim=-1)
        lo, hi = self.cfg.log_std_min, self.cfg.log_std_max
        log_std = lo + 0.5 * (hi - lo) * (torch.tanh(log_std) + 1.0)
        return mean, log_std

    def _shape(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.chunk_size == 1 else flat.view(flat.shape[0], self.chunk_size, self.action_dim)

    def sample_flat(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample, flat: (actions [B, H*A], log_prob [B])."""
        mean, log_std = self.dist_params(obs, prefix)
        std = log_std.exp()
        eps = torch.randn_like(mean)
        u = mean + std * eps
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)).sum(-1)
        return torch.tanh(u), logp

    def sample(self, obs: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample: (actions [B, A] (or [B, H, A] if chunked), log_prob [B])."""
        a, logp = self.sample_flat(obs)
        return self._shape(a), logp

    def log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """Log density [B] of ``actions`` ([B, A] or [B, H, A], in [-1, 1]) under the policy."""
        mean, log_std = self.dist_params(obs)
        eps_a = self.cfg.atanh_eps
        a = actions.reshape(actions.shape[0], -1).to(mean.dtype).clamp(-1 + eps_a, 1 - eps_a)
        u = torch.atanh(a)
        z = (u - mean) / log_std.exp()
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)).sum(-1)

    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """Behaviour cloning: mean negative log-likelihood of ``batch["action"]``."""
        return -self.log_prob(batch, batch["action"]).mean()

    # -- Policy protocol --------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False) -> ActionChunk:
        """Actions [B, H, A] float32 in [-1, 1]; log_prob [B] (None when deterministic)."""
        if deterministic:
            mean, _ = self.dist_params(obs)
            a, logp = torch.tanh(mean), None
        else:
            a, logp = self.sample_flat(obs)
        return ActionChunk(a.float().view(a.shape[0], self.chunk_size, self.action_dim), logp)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """All the actor's tensors, detached clones on CPU (this is what actors receive)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state, strict=True)


# -- critic -------------------------------------------------------------------------------
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
    """E Q-functions Q_i(s, a) -> [E, B] with one observation encoder shared by the members.

    The encoder is the critic's own (never the actor's); with cameras its CNNs are trained
    by the critic loss only. ``encoder_cfg`` supplies the encoder's fields (``cnn_channels``,
    ``image_embed_dim``, ``state_embed_dim``); ``chunk_size`` makes the critic score whole
    action chunks (flattened to H*A inputs).
    """

    def __init__(self, spec: EnvSpec, *, num_critics: int = 2,
                 hidden_dims: tuple[int, ...] = (256, 256), layer_norm: bool = True,
                 activation: str = "relu", chunk_size: int = 1,
                 encoder_cfg: MLPPolicyConfig | None = None):
        super().__init__()
        if num_critics < 1:
            raise ValueError(f"num_critics must be >= 1, got {num_critics}")
        self.num_critics = int(num_critics)
        self.encoder = ObsEncoder(spec, encoder_cfg or MLPPolicyConfig())
        layers: list[nn.Module] = []
        d = self.encoder.out_dim + chunk_size * spec.action_dim
        for h in hidden_dims:
            layers.append(EnsembleLinear(num_critics, d, h))
            if layer_norm:
                layers.append(EnsembleLayerNorm(num_critics, h))
            layers.append(_act(activation))
            d = h
        layers.append(EnsembleLinear(num_critics, d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Batch, actions: torch.Tensor, prefix: str = "") -> torch.Tensor:
        """Q-values [E, B] for ``actions`` [B, A] / [B, H, A] / [B, H*A]."""
        feats = self.encoder(obs, prefix)
        x = torch.cat([feats, actions.reshape(actions.shape[0], -1).to(feats.dtype)], dim=-1)
        x = x.unsqueeze(0).expand(self.num_critics, *x.shape)
        return self.net(x).squeeze(-1)
