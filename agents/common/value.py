"""A state-value network for policies without a value head (not a :class:`agents.base.ValuePolicy`).

Its own observation encoder (:class:`agents.common.encoders.ObsEncoder`: per-camera CNN + state MLP,
or the raw state) and an MLP to one output. Optionally the task instruction enters as a
learned embedding of its hash bucket (multi-task envs: the value depends on the task).

Shapes (B = batch):

    obs["observation.state"]          float32 [B, S]
    obs["observation.images.<cam>"]   uint8   [B, Hi, Wi, 3]
    obs["task"]                       list[str] of length B (only with ``task_buckets``)
    ValueNet.value(obs)               float32 [B]
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from agents.base import Batch
from agents.common.encoders import ObsEncoder, activation
from data.core.schema import TASK
from data.core.spec import EnvSpec


@dataclass
class ValueNetConfig:
    #: widths of the hidden layers after the observation encoder
    hidden_dims: tuple[int, ...] = (64, 64)
    #: activation of the hidden layers: "relu", "elu", "gelu", "silu" or "tanh"
    activation: str = "tanh"
    #: conv channels of the per-camera CNN (unused without cameras)
    cnn_channels: tuple[int, ...] = (16, 16)
    #: per-camera embedding size
    image_embed_dim: int = 32
    #: state MLP width with cameras (0: the raw state)
    state_embed_dim: int = 32
    #: hash buckets of a learned task-instruction embedding (0: the task is not an input)
    task_buckets: int = 0
    #: size of that embedding
    task_embed_dim: int = 16


def _act(name: str) -> nn.Module:
    return nn.Tanh() if name == "tanh" else activation(name)


class ValueNet(nn.Module):
    """V(obs) -> [B]: the critic PPO trains next to a policy without a value head."""

    def __init__(self, cfg: ValueNetConfig, spec: EnvSpec):
        super().__init__()
        self.cfg = cfg
        self.encoder = ObsEncoder(spec, cfg)
        d = self.encoder.out_dim
        self.task_embed = None
        if cfg.task_buckets > 0:
            self.task_embed = nn.Embedding(int(cfg.task_buckets), int(cfg.task_embed_dim))
            d += int(cfg.task_embed_dim)
        layers: list[nn.Module] = []
        for h in cfg.hidden_dims:
            layers += [nn.Linear(d, h), _act(cfg.activation)]
            d = h
        out = nn.Linear(d, 1)
        nn.init.zeros_(out.bias)
        nn.init.normal_(out.weight, std=0.01)
        self.mlp = nn.Sequential(*layers, out)

    def _task_ids(self, obs: Batch, n: int, device) -> torch.Tensor:
        tasks = obs.get(TASK) or [""] * n
        buckets = int(self.cfg.task_buckets)
        return torch.tensor([zlib.crc32(str(t).encode()) % buckets for t in tasks],
                            dtype=torch.long, device=device)

    def value(self, obs: Batch) -> torch.Tensor:
        """State value [B]."""
        h = self.encoder(obs)
        if self.task_embed is not None:
            h = torch.cat([h, self.task_embed(self._task_ids(obs, h.shape[0], h.device))], -1)
        return self.mlp(h).squeeze(-1)

    def forward(self, obs: Batch) -> torch.Tensor:
        return self.value(obs)
