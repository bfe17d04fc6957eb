"""Observation encoders shared by policies and critics: a small CNN per camera + state MLP.

Shapes (B = batch, S = state dim):

    obs["observation.state"]          float32 [B, S]
    obs["observation.images.<cam>"]   uint8   [B, Hi, Wi, 3]   (one per camera of the spec)
    ObsEncoder(obs)                   float32 [B, out_dim]

``ObsEncoder`` reads its sizes from any config object with ``cnn_channels``,
``image_embed_dim`` and ``state_embed_dim`` (:class:`agents.policies.mlp.MLPPolicyConfig`,
:class:`agents.sac.SACConfig`'s critic fields through :class:`EncoderConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agents.base import Batch
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.core.spec import EnvSpec


@dataclass
class EncoderConfig:
    #: output channels of the conv layers of the per-camera CNN (3x3 kernels, first stride 2)
    cnn_channels: tuple[int, ...] = (32, 32, 32, 32)
    #: size of each camera's embedding (linear + LayerNorm + tanh after the CNN)
    image_embed_dim: int = 50
    #: hidden width of the state MLP used when there are cameras (0: feed the raw state)
    state_embed_dim: int = 64


ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}


def activation(name: str) -> nn.Module:
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}") from None


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

    def __init__(self, spec: EnvSpec, cfg: EncoderConfig):
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


