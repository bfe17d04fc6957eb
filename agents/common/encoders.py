"""Observation encoders shared by policies and critics: a small CNN per camera + state MLP.

Shapes (B = batch, S = state dim):

    obs["observation.state"]          float32 [B, S]
    obs["observation.images.<cam>"]   uint8   [B, Hi, Wi, 3]   (one per camera of the spec)
    ObsEncoder(obs)                   float32 [B, out_dim]

``ObsEncoder`` reads its sizes from any config object with ``cnn_channels``,
``image_embed_dim`` and ``state_embed_dim`` (:class:`agents.policies.mlp.MLPPolicyConfig`,
:class:`agents.sac.agent.SACConfig`'s critic fields through :class:`EncoderConfig`), and optionally
``image_encoder`` / ``pool_features`` (absent: ``"flatten"``).

Two image encoders (``image_encoder``):

- ``"flatten"`` (:class:`ImageEncoder`, one per camera): 3x3 convs (first stride 2), the
  conv output flattened into a linear layer. At 128x128 with 32 channels that linear layer
  alone has ~5.5M parameters per camera.
- ``"pool"`` (:class:`PooledImageEncoders`): one strided conv backbone shared by all cameras
  (kernels 7, 5, 3, 3, ..., every stride 2; the cameras go through it as one batch when their
  shapes match), then per camera a learned spatial embedding (:class:`SpatialLearnedEmbeddings`,
  SERL / LeRobot HIL-SERL) and linear + LayerNorm + tanh. ~0.1M parameters for two cameras.

The instruction (``obs["task"]``, list[str]) is read only with ``task_embed_dim`` > 0 on a
spec with tasks (:class:`TaskEncoder`: a bag of words, each word hashed into one of
``task_buckets`` learned embeddings, averaged, then LayerNorm + tanh); otherwise it is ignored.
"""

from __future__ import annotations

import hashlib
import math
import threading
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
    #: "flatten" (per-camera CNN, flattened into a linear layer) or "pool" (shared strided CNN
    #: + learned spatial pooling per camera)
    image_encoder: str = "flatten"
    #: learned spatial features per channel of the "pool" encoder
    pool_features: int = 8
    #: "pool": keep the conv backbone at its (seeded) initialisation, train pooling and heads
    #: only (LeRobot HIL-SERL's default); its outputs are memoised per input batch
    freeze_backbone: bool = False
    #: frozen backbone: its outputs kept per distinct image (by content), at most this many
    #: (first in, first out; 0: none), so a stored observation is encoded once, not per batch
    backbone_cache: int = 50_000
    #: size of the instruction's embedding (:class:`TaskEncoder`); 0: the instruction is ignored
    task_embed_dim: int = 0
    #: hash buckets (learned word embeddings) of the instruction encoder
    task_buckets: int = 256
    #: embed the state (linear + LayerNorm + tanh to ``state_embed_dim``) also when there are
    #: no cameras (LeRobot's gaussian_actor does); False: a state-only encoder feeds it raw
    state_embed_without_images: bool = False


IMAGE_ENCODERS = ("flatten", "pool")


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
        return self.head(self.convs(_to_float(img)))


def _to_float(img: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, 3, H, W] in [-0.5, 0.5]."""
    return img.permute(0, 3, 1, 2).float().div(255.0) - 0.5


POOL_KERNELS = (7, 5, 3)


def strided_backbone(channels: tuple[int, ...]) -> nn.Sequential:
    """Convs with kernels 7, 5, 3, 3, ... and stride 2 each, ReLU after each (LeRobot's
    default HIL-SERL image encoder for ``channels=(32, 32, 32, 32)``)."""
    layers: list[nn.Module] = []
    cin = 3
    for i, cout in enumerate(channels):
        layers += [nn.Conv2d(cin, cout, POOL_KERNELS[min(i, len(POOL_KERNELS) - 1)], stride=2),
                   nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers)


class SpatialLearnedEmbeddings(nn.Module):
    """[B, C, H, W] -> [B, C * F]: for each channel, F learned weightings of the H x W map."""

    def __init__(self, channels: int, height: int, width: int, num_features: int):
        super().__init__()
        # each output is a weighted sum over the H*W positions of one channel: fan-in H*W
        self.kernel = nn.Parameter(torch.randn(channels, height * width, num_features)
                                   / math.sqrt(height * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        # [C, B, HW] @ [C, HW, F] -> [C, B, F]
        out = torch.bmm(x.reshape(b, c, -1).transpose(0, 1), self.kernel)
        return out.transpose(0, 1).reshape(b, -1)


class _SharedMemo:
    """The last (inputs, outputs) of a frozen backbone. ``copy.deepcopy`` returns it as is, so
    a target network copied from the online one shares it: equal frozen weights (a soft update
    of equal tensors keeps them equal), so the target reads the online pass on the same batch.
    Inputs are held by reference and compared with ``is``: they stay alive while memoised."""

    def __init__(self):
        self.last: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def __deepcopy__(self, memo):
        return self

    def get(self, images: list[torch.Tensor]) -> list[torch.Tensor] | None:
        last = self.last
        if last is not None and len(last[0]) == len(images) and all(a is b for a, b in zip(last[0], images)):
            return last[1]
        return None


class _MapCache:
    """A frozen backbone's output per distinct image: key a 16-byte BLAKE2 digest of the
    image's bytes, at most ``max_rows`` entries (first in, first out). Exact while the backbone
    is frozen. Shared by deep copies (target, serving copy), like :class:`_SharedMemo`."""

    def __init__(self, max_rows: int):
        self.max_rows = int(max_rows)
        self._rows: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __deepcopy__(self, memo):
        return self

    def __len__(self) -> int:
        return len(self._rows)

    def maps(self, backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> backbone output [N, C, h, w], computing only unseen images."""
        flat = x.detach().cpu().contiguous().numpy().reshape(x.shape[0], -1)
        keys = [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in flat]
        with self._lock:
            rows = [self._rows.get(k) for k in keys]
        missing = [i for i, r in enumerate(rows) if r is None]
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        if missing:
            idx = torch.tensor(missing, device=x.device)
            out = backbone(_to_float(x.index_select(0, idx)))
            with self._lock:
                for j, i in enumerate(missing):
                    rows[i] = self._rows[keys[i]] = out[j]
                while len(self._rows) > self.max_rows:
                    self._rows.pop(next(iter(self._rows)))
        return torch.stack(rows)


class PooledImageEncoders(nn.Module):
    """All cameras: {key: uint8 [B, H, W, 3]} -> [B, n_cams * embed_dim].

    One strided backbone (:func:`strided_backbone`) shared by the cameras; cameras of equal
    shape are stacked into one backbone call. Per camera: spatial embedding, linear,
    LayerNorm, tanh."""

    def __init__(self, shapes: list[tuple[int, int, int]], channels: tuple[int, ...],
                 embed_dim: int, num_features: int, freeze_backbone: bool = False,
                 backbone_cache: int = 0):
        super().__init__()
        for shape in shapes:
            if shape[2] != 3:
                raise ValueError(f"images must be [H, W, 3], got {shape}")
        if num_features < 1:
            raise ValueError(f"pool_features must be >= 1, got {num_features}")
        self.backbone = strided_backbone(channels)
        self.pools = nn.ModuleList()
        self.heads = nn.ModuleList()
        for h, w, _ in shapes:
            with torch.no_grad():
                _, c, fh, fw = self.backbone(torch.zeros(1, 3, h, w)).shape
            self.pools.append(SpatialLearnedEmbeddings(c, fh, fw, num_features))
            self.heads.append(nn.Sequential(nn.Linear(c * num_features, embed_dim),
                                            nn.LayerNorm(embed_dim), nn.Tanh()))
        self.same_shape = len(set(shapes)) == 1
        self.freeze_backbone = bool(freeze_backbone)
        if self.freeze_backbone:
            self.backbone.requires_grad_(False)
            self._memo = _SharedMemo()
        self._cache = _MapCache(backbone_cache) if self.freeze_backbone and backbone_cache > 0 else None

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self._cache.maps(self.backbone, x) if self._cache is not None else self.backbone(_to_float(x))

    def _maps(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.same_shape and len(images) > 1:
            return list(self._run(torch.cat(images, dim=0)).chunk(len(images), dim=0))
        return [self._run(img) for img in images]

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.freeze_backbone:
            maps = self._memo.get(images)
            if maps is None:
                with torch.no_grad():
                    maps = self._maps(images)
                self._memo.last = (list(images), maps)
        else:
            maps = self._maps(images)
        return [head(pool(m)) for m, pool, head in zip(maps, self.pools, self.heads)]


def word_bucket(word: str, buckets: int) -> int:
    """A stable bucket of ``word`` (lower-cased): the same in every process and run."""
    digest = hashlib.blake2b(word.lower().encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


class TaskEncoder(nn.Module):
    """Instructions list[str] (length B) -> float32 [B, embed_dim]: the mean of the learned
    embeddings of the words' hash buckets (an empty instruction: a zero mean), LayerNorm, tanh."""

    def __init__(self, embed_dim: int, buckets: int):
        super().__init__()
        if embed_dim < 1 or buckets < 1:
            raise ValueError(f"task_embed_dim and task_buckets must be >= 1, got {embed_dim}, {buckets}")
        self.buckets = int(buckets)
        self.bag = nn.EmbeddingBag(self.buckets, embed_dim, mode="mean")
        self.head = nn.Sequential(nn.LayerNorm(embed_dim), nn.Tanh())
        self._ids: dict[str, list[int]] = {}

    def forward(self, tasks, device: torch.device) -> torch.Tensor:
        ids, offsets = [], []
        for t in tasks:
            words = self._ids.get(t)
            if words is None:
                words = self._ids[t] = [word_bucket(w, self.buckets) for w in str(t).split()]
            offsets.append(len(ids))
            ids += words
        out = self.bag(torch.tensor(ids, dtype=torch.long, device=device),
                       torch.tensor(offsets, dtype=torch.long, device=device))
        return self.head(out)


class ObsEncoder(nn.Module):
    """Observation dict -> flat features [B, out_dim].

    State-only specs: the raw state (identity). With cameras: the image encoder of
    ``cfg.image_encoder`` (one :class:`ImageEncoder` per camera, sorted by name, or one
    :class:`PooledImageEncoders` for all) and a state MLP, concatenated.
    """

    def __init__(self, spec: EnvSpec, cfg: EncoderConfig):
        super().__init__()
        self.image_keys = spec.image_keys
        kind = getattr(cfg, "image_encoder", "flatten")
        if kind not in IMAGE_ENCODERS:
            raise ValueError(f"image_encoder must be one of {IMAGE_ENCODERS}, got {kind!r}")
        self.image_encoder = kind
        shapes = [tuple(spec.cameras[k[len(OBS_IMAGE_PREFIX):]]) for k in self.image_keys]
        if kind == "pool" and self.image_keys:
            self.pooled = PooledImageEncoders(shapes, tuple(cfg.cnn_channels), cfg.image_embed_dim,
                                              int(getattr(cfg, "pool_features", 8)),
                                              bool(getattr(cfg, "freeze_backbone", False)),
                                              int(getattr(cfg, "backbone_cache", 0)))
        self.cams = nn.ModuleDict({
            str(i): ImageEncoder(shape, cfg.cnn_channels, cfg.image_embed_dim)
            for i, shape in enumerate(shapes) if kind == "flatten"
        })
        embed = bool(self.image_keys) or bool(getattr(cfg, "state_embed_without_images", False))
        if embed and cfg.state_embed_dim > 0:
            self.state = nn.Sequential(nn.Linear(spec.state_dim, cfg.state_embed_dim),
                                       nn.LayerNorm(cfg.state_embed_dim), nn.Tanh())
            state_out = cfg.state_embed_dim
        else:
            self.state = nn.Identity()
            state_out = spec.state_dim
        self.out_dim = state_out + len(self.image_keys) * cfg.image_embed_dim
        task_dim = int(getattr(cfg, "task_embed_dim", 0))
        self.task = TaskEncoder(task_dim, int(getattr(cfg, "task_buckets", 256))) \
            if task_dim > 0 and spec.has_task else None
        self.out_dim += task_dim if self.task is not None else 0

    def forward(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        feats = [self.state(obs[prefix + OBS_STATE].float())]
        if self.image_encoder == "pool" and self.image_keys:
            feats += self.pooled([obs[prefix + k] for k in self.image_keys])
        else:
            for i, k in enumerate(self.image_keys):
                feats.append(self.cams[str(i)](obs[prefix + k]))
        if self.task is not None:
            if "task" not in obs:
                raise KeyError("this encoder reads the instruction (task_embed_dim > 0): the batch has no 'task'")
            feats.append(self.task(obs["task"], feats[0].device))
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)


