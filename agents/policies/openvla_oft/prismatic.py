"""OpenVLA-OFT's network, rebuilt on stock timm + transformers (no trust_remote_code).

Module names and tensor layouts are those of the published OpenVLA / OpenVLA-OFT
checkpoints (``modeling_prismatic.py`` of openvla-oft, ``prismatic/models/action_heads.py``,
``prismatic/models/projectors.py``), so their safetensors load key for key:

    vision_backbone.featurizer.*        timm DINOv2 ViT-L/14 (+4 registers), LayerScale
                                        ``gamma`` renamed ``scale_factor``
    vision_backbone.fused_featurizer.*  timm SigLIP So400m/14
    projector.fc1/fc2/fc3               fused GELU MLP (vision dim -> 4x -> llm -> llm)
    language_model.*                    transformers LlamaForCausalLM (Llama-2-7B)
    action_head (file action_head--*)   L1 regression MLP-ResNet: ``model.*``
    proprio_projector (proprio_projector--*)  ``fc1``, ``fc2``

Both ViTs return the patch tokens of their second-to-last block; with N images, each image
is [DINOv2 pixels, SigLIP pixels] stacked on channels and the patch sequences are
concatenated. The language model runs with *bidirectional* attention (OFT's parallel
decoding; OFT ships a transformers fork for it, here a 4-D padding-only mask does it).

Shapes (B batch, n images, P patches per image, D llm width, K = chunk * A action tokens):

    pixel_values     [B, 6n, S, S]      -> patch features [B, nP, D] (+1 proprio token)
    input_ids        [B, L]  = <s> prompt "▁" K placeholders </s> <pad>...
    action_hidden    [B, K, D]
    action head      [B, K, D] -> [B, chunk, A] (normalised actions in [-1, 1])
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_TIMM_IDS = ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224")


@dataclass
class PrismaticConfig:
    """The fields of an OpenVLA ``config.json`` this module reads (others are kept as-is)."""

    timm_model_ids: tuple[str, ...] = DEFAULT_TIMM_IDS
    image_sizes: tuple[int, ...] = (224, 224)
    use_fused_vision_backbone: bool = True
    timm_override_act_layers: tuple[Any, ...] = (None, None)
    #: LlamaConfig fields; unspecified ones are LlamaConfig defaults (= Llama-2-7B)
    text_config: dict = field(default_factory=lambda: {"model_type": "llama", "vocab_size": 32064, "pad_token_id": 32000})
    pad_token_id: int = 32000
    pad_to_multiple_of: int = 64
    n_action_bins: int = 256
    arch_specifier: str = "no-align+fused-gelu-mlp"
    image_resize_strategy: str = "resize-naive"
    norm_stats: dict | None = None
    #: Tandem extension (test sizes): per-backbone kwargs overriding the timm model's args
    tandem_timm_overrides: tuple[dict, ...] | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "PrismaticConfig":
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {k: (tuple(v) if isinstance(v, list) and k != "text_config" else v) for k, v in d.items() if k in names}
        return cls(**kw, extra={k: v for k, v in d.items() if k not in names})

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        if d["tandem_timm_overrides"] is None:
            del d["tandem_timm_overrides"]
        return {"model_type": "openvla", "architectures": ["OpenVLAForActionPrediction"], **extra, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @property
    def llama_config(self):
        from transformers import LlamaConfig

        kw = {k: v for k, v in self.text_config.items() if k not in ("model_type", "torch_dtype", "dtype")}
        return LlamaConfig(**kw)

    @property
    def base_vocab_size(self) -> int:
        """Tokenizer vocabulary without the <PAD> padding: the last ``n_action_bins`` of it
        are the action tokens (OpenVLA's ``vocab_size - pad_to_multiple_of``)."""
        return int(self.llama_config.vocab_size) - int(self.pad_to_multiple_of)


# -- vision -----------------------------------------------------------------------------------
def _ls_forward(self, x: torch.Tensor) -> torch.Tensor:
    return x.mul_(self.scale_factor) if self.inplace else x * self.scale_factor


def _ls_apply_patch(ls) -> None:
    """timm LayerScale ``gamma`` -> ``scale_factor`` (the published key names)."""
    ls.scale_factor = nn.Parameter(ls.gamma.clone())
    ls.forward = _ls_forward.__get__(ls, type(ls))
    del ls.gamma


def _second_to_last(featurizer, x: torch.Tensor) -> torch.Tensor:
    out = featurizer.get_intermediate_layers(x, n={len(featurizer.blocks) - 2})
    return out[0] if isinstance(out, (tuple, list)) else out


class PrismaticVisionBackbone(nn.Module):
    """DINOv2 (+ fused SigLIP) patch features of every input image, concatenated."""

    def __init__(self, cfg: PrismaticConfig, num_images: int = 1):
        super().__init__()
        import timm
        from timm.layers import LayerScale

        self.use_fused = cfg.use_fused_vision_backbone
        self.num_images = num_images
        over = list(cfg.tandem_timm_overrides or ({}, {}))
        n = 2 if self.use_fused else 1
        if len(cfg.timm_model_ids) < n:
            raise ValueError(f"a fused backbone needs 2 timm_model_ids, got {cfg.timm_model_ids}")
        feats = []
        for i in range(n):
            m = timm.create_model(cfg.timm_model_ids[i], pretrained=False, num_classes=0, img_size=cfg.image_sizes[i],
                                  act_layer=cfg.timm_override_act_layers[i], **dict(over[i] if i < len(over) else {}))
            for mod in m.modules():
                if isinstance(mod, LayerScale):
                    _ls_apply_patch(mod)
            feats.append(m)
        self.featurizer = feats[0]
        self.fused_featurizer = feats[1] if self.use_fused else None
        self.embed_dim = sum(f.embed_dim for f in feats)
        self.pixel_stats = [(f.pretrained_cfg.get("mean", (0.5,) * 3), f.pretrained_cfg.get("std", (0.5,) * 3))
                            for f in feats]

    @property
    def num_patches(self) -> int:
        return int(self.featurizer.patch_embed.num_patches)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 6n (3n if not fused), S, S] -> [B, n * P, embed_dim]."""
        per = 6 if self.use_fused else 3
        b, n = pixel_values.shape[0], self.num_images
        x = pixel_values.reshape(b * n, per, *pixel_values.shape[-2:])  # all images in one ViT call
        if self.use_fused:
            x, y = torch.split(x, [3, 3], dim=1)
            feats = torch.cat([_second_to_last(self.featurizer, x), _second_to_last(self.fused_featurizer, y)], dim=2)
        else:
            feats = _second_to_last(self.featurizer, x)
        return feats.reshape(b, n * feats.shape[1], feats.shape[2])  # image 0's patches, then image 1's...


class PrismaticProjector(nn.Module):
    def __init__(self, fused: bool, vision_dim: int, llm_dim: int):
        super().__init__()
        self.fused = fused
        if fused:
            self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
            self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
            self.fc3 = nn.Linear(llm_dim, llm_dim)
        else:
            self.fc1 = nn.Linear(vision_dim, llm_dim)
            self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1, self.act_fn2 = nn.GELU(), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(self.act_fn1(self.fc1(x)))
        return self.fc3(self.act_fn2(x)) if self.fused else x


# -- OFT heads ----------------------------------------------------------------------------------
class MLPResNetBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList([MLPResNetBlock(hidden_dim) for _ in range(num_blocks)])
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """OFT's continuous head: the A hidden states of each chunk step -> that step's A actions."""

    def __init__(self, input_dim: int, hidden_dim: int, action_dim: int, chunk: int):
        super().__init__()
        self.action_dim, self.chunk = action_dim, chunk
        self.model = MLPResNet(2, input_dim * action_dim, hidden_dim, action_dim)

    def predict_action(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, chunk * A, D] -> [B, chunk, A]."""
        return self.model(hidden.reshape(hidden.shape[0], self.chunk, -1))


class ProprioProjector(nn.Module):
    def __init__(self, llm_dim: int, proprio_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn1(self.fc1(x)))


# -- the VLA ----------------------------------------------------------------------------------
class OpenVLA(nn.Module):
    """``vision_backbone`` + ``projector`` + ``language_model`` with OFT's parallel decoding."""

    def __init__(self, cfg: PrismaticConfig, num_images: int = 1):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.cfg = cfg
        self.vision_backbone = PrismaticVisionBackbone(cfg, num_images)
        llama = cfg.llama_config
        llama._attn_implementation = "sdpa"  # noqa: SLF001
        self.language_model = LlamaForCausalLM(llama)
        self.llm_dim = int(llama.hidden_size)
        self.projector = PrismaticProjector(cfg.use_fused_vision_backbone, self.vision_backbone.embed_dim, self.llm_dim)

    def action_hidden(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      action_mask: torch.Tensor, proprio_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, K, D] at the K action positions (``action_mask`` [B, L],
        the same K per row); action-token embeddings are zeroed, attention is bidirectional
        over every non-padding position."""
        lm = self.language_model.model
        emb = lm.embed_tokens(input_ids) * (~action_mask)[..., None].to(lm.embed_tokens.weight.dtype)
        patches = self.projector(self.vision_backbone(pixel_values.to(self.projector.fc1.weight.dtype)))
        if proprio_emb is not None:
            patches = torch.cat([patches, proprio_emb[:, None].to(patches.dtype)], dim=1)
        b, p = patches.shape[:2]
        x = torch.cat([emb[:, :1], patches.to(emb.dtype), emb[:, 1:]], dim=1)
        ones = attention_mask.new_ones(b, p)
        valid = torch.cat([attention_mask[:, :1], ones, attention_mask[:, 1:]], dim=1).bool()
        amask = torch.cat([action_mask[:, :1], torch.zeros_like(ones, dtype=torch.bool), action_mask[:, 1:]], dim=1)
        neg = torch.finfo(x.dtype).min
        mask4d = torch.zeros(b, 1, 1, x.shape[1], dtype=x.dtype, device=x.device).masked_fill(~valid[:, None, None], neg)
        mask4d = mask4d.expand(b, 1, x.shape[1], x.shape[1])
        h = lm(inputs_embeds=x, attention_mask=mask4d).last_hidden_state
        k = int(action_mask[0].sum())
        return h[amask].view(b, k, h.shape[-1])
