"""OpenVLA-OFT as a Tandem policy (network: :mod:`agents.policies.openvla_oft.prismatic`).

Two action heads over the same parallel-decoding VLA:

- ``action_head="l1"`` (OFT's published recipe): the L1-regression MLP-ResNet head turns the
  K = chunk x A action-position hidden states into a continuous chunk [B, chunk, A];
  ``bc_loss`` is OFT's L1 loss. Capabilities ``{"bc_loss"}``.
- ``action_head="discrete"`` (:class:`agents.policies.openvla_oft.discrete.OpenVLAOFTDiscretePolicy`, what RL needs): the language
  model head's logits over the 256 action tokens (the last 256 of the base vocabulary, as in
  OpenVLA) at each of the K positions, tempered by ``temperature``; ``act`` samples (or takes
  the argmax when deterministic) and returns the chunk's log-probability, ``log_prob(obs,
  actions)`` scores given actions, ``bc_loss`` is the cross-entropy. Capabilities
  ``{"bc_loss", "log_prob"}``.

Observations: each camera (in ``camera_order``, default the spec's sorted cameras: LIBERO's
``image`` then ``wrist_image``) resized to the backbone resolution and normalised per backbone;
the prompt ``"In: What action should the robot take to {task}?\\nOut:"`` tokenized with a local
Llama tokenizer (+ the "▁" token); the state, normalised with the dataset statistics
(BOUNDS_Q99 by default), goes through the proprio projector as one extra token.
Actions are un-normalised with ``dataset_statistics.json`` and clipped to [-1, 1].

Checkpoint layout (the published one): ``config.json`` (model_type openvla), ``model.safetensors``
or ``model.safetensors.index.json`` + shards, ``action_head--<step>_checkpoint.pt`` and
``proprio_projector--<step>_checkpoint.pt`` (torch.save'd state dicts, read only from local disk
with ``torch.load(weights_only=True)``; ``.safetensors`` versions are preferred when present),
``dataset_statistics.json``, and the tokenizer files.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch
from agents.policies import vla_common as vc
from agents.policies.fast_common import resolve_compile, warm_up
from agents.policies.fp8 import check_fp8, resolve_fp8
from agents.policies.openvla_oft.prismatic import (DEFAULT_TIMM_IDS, L1RegressionActionHead, OpenVLA, PrismaticConfig,
                                       ProprioProjector)
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.policies.openvla_oft")

_LORA_SCOPES = {"language_model": r"model\.language_model\.model", "vision": r"model\.vision_backbone",
                "projector": r"model\.projector"}
PROMPT = "In: What action should the robot take to {task}?\nOut:"


@dataclass
class OpenVLAOFTPolicyConfig:
    """Tandem's OpenVLA-OFT policy. Sequences are tuples (Hydra lists)."""

    #: local checkpoint folder in the published layout; None: random weights from ``seed``
    checkpoint: str | None = None
    #: local Llama tokenizer folder; None: the checkpoint folder
    tokenizer: str | None = None
    #: "l1" (continuous regression head) | "discrete" (256-bin action tokens)
    action_head: str = "l1"
    #: actions per chunk (OFT: 8 for LIBERO)
    chunk_size: int = 8
    #: softmax temperature of the discrete head
    temperature: float = 1.0
    #: dataset_statistics.json entry (None: the only one)
    unnorm_key: str | None = None
    #: "bounds_q99" (OFT LIBERO) | "bounds" (min/max) | "none"
    normalization: str = "bounds_q99"
    #: feed the state through the proprio projector
    use_proprio: bool = True
    #: OFT's test-time center crop (90% area) before resizing
    center_crop: bool = False
    #: env camera names in model input order (None: sorted)
    camera_order: tuple[str, ...] | None = None
    #: instruction for rows whose task is empty (None: an error)
    default_task: str | None = None
    #: fresh models only: timm ids, backbone resolution, LlamaConfig fields, test-size overrides
    timm_model_ids: tuple[str, ...] = DEFAULT_TIMM_IDS
    image_size: int = 224
    text_config: dict | None = None
    timm_overrides: tuple[dict, ...] | None = None
    device: str = "auto"
    dtype: str = "auto"
    lora_rank: int = 32
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    #: where adapters go: "language_model", "vision", "projector"
    lora_scopes: tuple[str, ...] = ("language_model",)
    #: modules trained in full: "action_head", "proprio_projector", "projector"
    trainable_heads: tuple[str, ...] = ("action_head", "proprio_projector")
    #: every parameter trains (a model trained from scratch; trainable_state_dict is the whole model)
    train_full: bool = False
    clip_actions: bool = True
    #: in eval mode, act with the adapters folded into the base weights (no adapter code in
    #: the forward; keeps a copy of the adapted base weights on the device)
    fold_lora_for_serving: bool = True
    #: the serving path of eval-mode ``act`` / ``forward_model`` (agents/policies/openvla_oft/fast.py):
    #: "auto" (CUDA graphs on a GPU, the eager path on a CPU) | "graphs" | "eager" (the fast
    #: computation without graphs) | "off"
    fast_serving: str = "auto"  # CUDA graphs on a GPU (H100: act 25.8 vs 37.0 ms eager), old path on a CPU
    #: torch.compile the language model's layers inside the fast path's graphs: "auto" (where
    #: graphs are captured: a GPU) | true | false (agents/policies/fast_common.py)
    fast_compile: Any = "auto"
    #: batch sizes whose graphs ``warm_up`` compiles and captures before serving (others: lazily)
    fast_warmup_buckets: tuple[int, ...] = (1, 2, 4, 8)
    #: ``warm_up`` also captures every token-row width a prompt of up to this many tokens pads to,
    #: so a longer instruction is not captured on its first act (0: the warm-up task's only)
    fast_warmup_prompt_tokens: int = 64
    #: the fast path's Llama linear layers in FP8 e4m3: false | true (torch._scaled_mm, sm_89+; refused
    #: at build elsewhere) | emulate (the same quantization through float32 matmuls: checks)
    #: (agents/policies/fp8.py); serving only, training stays bf16
    fast_llm_fp8: Any = False
    #: a folder for the compiled layer stack as ahead-of-time functions (agents/policies/fast_aot.py):
    #: loaded from it when there (no tracing at start-up), else compiled and saved; null: off
    fast_aot_dir: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.action_head not in ("l1", "discrete"):
            raise ValueError(f"action_head must be l1 or discrete, got {self.action_head!r}")
        if self.normalization not in ("bounds_q99", "bounds", "none"):
            raise ValueError(f"normalization must be bounds_q99, bounds or none, got {self.normalization!r}")
        if self.temperature <= 0 or self.chunk_size < 1 or self.lora_rank < 0:
            raise ValueError("temperature must be > 0, chunk_size >= 1, lora_rank >= 0")
        if self.fast_serving not in ("auto", "graphs", "eager", "off"):
            raise ValueError(f"policy.fast_serving must be auto, graphs, eager or off, got {self.fast_serving!r}")
        resolve_compile(self.fast_compile, False)  # raises on anything but auto / true / false
        resolve_fp8(self.fast_llm_fp8, "policy.fast_llm_fp8")


def _torch_load_local(path: Path) -> dict:
    """A published head file: a torch.save'd state dict, from local disk, tensors only."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


def _head_file(ckpt: Path, name: str) -> Path | None:
    files = [p for p in ckpt.iterdir() if p.name.startswith(f"{name}--") and p.suffix in (".pt", ".safetensors")]
    if not files:
        return None
    step = lambda p: int(m.group(1)) if (m := re.search(r"--(\d+)", p.name)) else -1  # noqa: E731
    return max(files, key=lambda p: (step(p), p.suffix == ".safetensors"))


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The VLA tensors of ``model.safetensors`` or its shards."""
    from safetensors.torch import load_file

    if (ckpt / "model.safetensors").exists():
        return load_file(str(ckpt / "model.safetensors"))
    index = ckpt / "model.safetensors.index.json"
    if not index.exists():
        raise vc.CheckpointMismatch(f"{str(ckpt)!r} has no model.safetensors nor model.safetensors.index.json "
                                    f"(found {sorted(p.name for p in ckpt.iterdir())})")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(ckpt / shard)))
    return out


class OpenVLAOFTPolicy(nn.Module):
    """OpenVLA-OFT behind :class:`agents.base.Policy` (see the module docstring)."""
    AOT_BY_DEFAULT = True  #: the learner keeps its ahead-of-time functions beside its compile artefacts

    head_kind = "l1"

    def __init__(self, cfg: OpenVLAOFTPolicyConfig, spec: EnvSpec):
        super().__init__()
        cfg.validate()
        if cfg.action_head != self.head_kind:
            raise ValueError(f"{type(self).__name__} uses action_head={self.head_kind!r}; use policy="
                             f"{'openvla_oft_discrete' if cfg.action_head == 'discrete' else 'openvla_oft'}")
        self.cfg, self.spec = cfg, spec
        self.who = "policy=openvla_oft" + ("_discrete" if self.head_kind == "discrete" else "")
        self.chunk_size, self.action_dim = int(cfg.chunk_size), spec.action_dim
        cams = list(cfg.camera_order) if cfg.camera_order else sorted(spec.cameras)
        if sorted(cams) != sorted(spec.cameras) or not cams:
            raise ValueError(f"{self.who}: camera_order {cams} must list the env cameras {sorted(spec.cameras)} (>= 1)")
        self.cams = [OBS_IMAGE_PREFIX + c for c in cams]
        dev = vc.resolve_device(cfg.device)
        if resolve_fp8(cfg.fast_llm_fp8, "policy.fast_llm_fp8") == "cuda":
            check_fp8(dev, "policy.fast_llm_fp8")  # refused now, not at the first act
        dtype = vc.resolve_dtype(cfg.dtype, dev)
        ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
        pcfg = self._read_config(ckpt)
        self.pcfg = pcfg
        # built directly on the device in the serving dtype (no float32 copy of a 7B model)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.device(dev), \
                vc.default_dtype(dtype):
            torch.manual_seed(cfg.seed)
            self.model = OpenVLA(pcfg, num_images=len(self.cams))
            d = self.model.llm_dim
            self.action_head = L1RegressionActionHead(d, d, self.action_dim, self.chunk_size) if self.head_kind == "l1" else None
            self.proprio_projector = ProprioProjector(d, spec.state_dim) if cfg.use_proprio else None
        self.stats = {}
        if ckpt is not None:
            self._load(ckpt)
        self.to(device=dev, dtype=dtype)
        for h in (self.action_head, self.proprio_projector):
            if h is not None:
                h.float()  # the small heads train in float32 (adapters too), the VLA stays in `dtype`
        tok_dir = cfg.tokenizer or (str(ckpt) if ckpt else None)
        if tok_dir is None:
            raise ValueError(f"{self.who}: set policy.tokenizer (a local Llama tokenizer folder) or a checkpoint")
        self.tokenizer = vc.load_local_tokenizer(tok_dir, self.who,
                                                 builtin=("llama", int(pcfg.pad_token_id or pcfg.llama_config.vocab_size)))
        self._prep_tokens()
        if cfg.lora_rank > 0:
            regex = vc.lora_regex(_LORA_SCOPES, cfg.lora_scopes, cfg.lora_target_modules)
            vc.add_lora(self, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, target_regex=regex)
        heads = [h if h != "projector" else "model.projector" for h in cfg.trainable_heads
                 if getattr(self, h, True) is not None]
        vc.set_trainable(self, heads)
        if cfg.train_full:
            self.requires_grad_(True)
        self.lora = vc.LoRAServing(self)
        self._pixel_stats = [(torch.tensor(m, device=dev).view(1, 3, 1, 1), torch.tensor(s, device=dev).view(1, 3, 1, 1))
                             for m, s in self.model.vision_backbone.pixel_stats]

    # -- construction -----------------------------------------------------------------------------
    def _read_config(self, ckpt: Path | None) -> PrismaticConfig:
        cfg = self.cfg
        if ckpt is None:
            text = cfg.text_config or {"model_type": "llama", "vocab_size": 32064, "pad_token_id": 32000}
            return PrismaticConfig(timm_model_ids=tuple(cfg.timm_model_ids), image_sizes=(cfg.image_size,) * 2,
                                   text_config=dict(text), tandem_timm_overrides=cfg.timm_overrides,
                                   pad_token_id=int(text.get("pad_token_id", 32000)))
        f = ckpt / "config.json"
        if not f.is_file():
            raise vc.CheckpointMismatch(f"{self.who}: {str(ckpt)!r} is not an OpenVLA checkpoint folder (no config.json)")
        d = json.loads(f.read_text())
        if d.get("model_type") not in ("openvla", "prismatic") or "timm_model_ids" not in d:
            raise vc.CheckpointMismatch(f"{self.who}: {str(f)!r} is not an OpenVLA config (model_type="
                                        f"{d.get('model_type')!r}, timm_model_ids {'present' if 'timm_model_ids' in d else 'missing'})")
        return PrismaticConfig.from_dict(d)

    def _load(self, ckpt: Path) -> None:
        where = repr(str(ckpt))
        sd = read_weights(ckpt)
        vc.check_state_layout(self.model.state_dict(), sd, where, "the OpenVLA architecture of its config.json")
        self.model.load_state_dict(sd, strict=True)
        for name in ("action_head", "proprio_projector"):
            mod = getattr(self, name)
            if mod is None:
                continue
            path = _head_file(ckpt, name)
            if path is None:
                raise vc.CheckpointMismatch(f"{self.who}: checkpoint {where} has no {name}--*.pt/.safetensors file")
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file
                hsd = load_file(str(path))
            else:
                hsd = _torch_load_local(path)
            hsd = {k.removeprefix("module."): v for k, v in hsd.items()}
            vc.check_state_layout(mod.state_dict(), hsd, repr(str(path)),
                                  f"a {name} for {self.chunk_size}x{self.action_dim} actions, "
                                  f"{self.spec.state_dim}-D state, width {self.model.llm_dim}")
            mod.load_state_dict(hsd, strict=True)
        stats_file = ckpt / "dataset_statistics.json"
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else (self.pcfg.norm_stats or {})
        if self.cfg.normalization != "none":
            key = self.cfg.unnorm_key
            if key is None:
                if len(stats) != 1:
                    raise ValueError(f"{self.who}: set policy.unnorm_key to one of {sorted(stats)}")
                key = next(iter(stats))
            if key not in stats:
                raise ValueError(f"{self.who}: unnorm_key {key!r} not in the dataset statistics {sorted(stats)}")
            self.stats = stats[key]

    def _prep_tokens(self) -> None:
        tok, pc = self.tokenizer, self.pcfg
        self.base_vocab = pc.base_vocab_size
        n_bins = int(pc.n_action_bins)
        if len(tok) > pc.llama_config.vocab_size or self.base_vocab < n_bins:
            raise ValueError(f"{self.who}: tokenizer ({len(tok)} tokens) does not fit the model vocabulary "
                             f"({pc.llama_config.vocab_size}, {n_bins} action bins)")
        self.space_id = tok.convert_tokens_to_ids("▁")
        self.stop_id = tok.eos_token_id
        self.pad_id = pc.pad_token_id if pc.pad_token_id is not None else tok.pad_token_id
        self.k = self.chunk_size * self.action_dim
        self._rows: dict[str, list[int]] = {}
        # action token of bin class j (0..255) is base_vocab - 256 + j; its value is OpenVLA's
        # bin_centers[clip(base_vocab - token - 1, 0, 254)]
        bins = torch.linspace(-1, 1, n_bins, device=self.device)  # float32 even over a bf16 model
        centers = (bins[:-1] + bins[1:]) / 2
        idx = (n_bins - 1 - torch.arange(n_bins, device=self.device)).clamp(0, n_bins - 2)
        self.register_buffer("bins", bins, persistent=False)
        self.register_buffer("class_values", centers[idx], persistent=False)

    # -- observation mapping ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.projector.fc1.weight.device

    def _bounds(self, key: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(low, high, mask) of ``key`` ("action"/"proprio"), cached per device."""
        cache = self.__dict__.setdefault("_bounds_cache", {})
        if (key, device) not in cache:
            s = self.stats.get(key) if self.stats else None
            if self.cfg.normalization == "none" or not s:
                cache[(key, device)] = None
            else:
                lo, hi = ("q01", "q99") if self.cfg.normalization == "bounds_q99" else ("min", "max")
                t = lambda v, dt=torch.float32: torch.tensor(v, device=device, dtype=dt)  # noqa: E731
                cache[(key, device)] = (t(s[lo]), t(s[hi]), t(s.get("mask", [True] * len(s[lo])), torch.bool))
        return cache[(key, device)]

    def _normalize(self, x: torch.Tensor, key: str, inverse: bool = False) -> torch.Tensor:
        """OFT's BOUNDS(_Q99) (un)normalisation; dims with mask False pass through."""
        b = self._bounds(key, x.device)
        if b is None:
            return x
        lo, hi, mask = b
        if inverse:
            y = 0.5 * (x.clamp(-1, 1) + 1) * (hi - lo + 1e-8) + lo
        else:
            y = (2 * (x - lo) / (hi - lo + 1e-8) - 1).clamp(-1, 1)
        return torch.where(mask, y, x)

    def _pixels(self, obs: Batch) -> torch.Tensor:
        size = self.pcfg.image_sizes[0]
        out = []
        for k in self.cams:
            img = obs[k].to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255.0)
            if self.cfg.center_crop:  # OFT eval: crop sqrt(0.9) of each side, centred
                h, w = img.shape[-2:]
                ch, cw = round(h * math.sqrt(0.9)), round(w * math.sqrt(0.9))
                img = img[..., (h - ch) // 2:(h - ch) // 2 + ch, (w - cw) // 2:(w - cw) // 2 + cw]
            if tuple(img.shape[-2:]) != (size, size):
                img = F.interpolate(img, size=(size, size), mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
            for mean, std in self._pixel_stats:
                out.append((img - mean.to(img.device)) / std.to(img.device))
        return torch.cat(out, dim=1)

    def _token_rows(self, tasks: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = []
        for t in tasks:
            if t not in self._rows:
                ids = list(self.tokenizer(PROMPT.format(task=t.lower().strip()))["input_ids"])
                if ids[-1] != self.space_id:
                    ids.append(self.space_id)
                if len(self._rows) > 4096:
                    self._rows.clear()
                self._rows[t] = ids
            rows.append(self._rows[t])
        n = max(len(r) for r in rows) + self.k + 1
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(rows), n, dtype=torch.bool)
        act = torch.zeros(len(rows), n, dtype=torch.bool)
        for i, r in enumerate(rows):
            m = len(r)
            ids[i, :m] = torch.tensor(r)
            ids[i, m:m + self.k] = 1  # placeholders (embeddings are zeroed)
            ids[i, m + self.k] = self.stop_id
            valid[i, :m + self.k + 1] = True
            act[i, m:m + self.k] = True
        dev = self.device
        return ids.to(dev), valid.to(dev), act.to(dev)

    def model_inputs(self, obs: Batch) -> tuple:
        """(pixel_values, input_ids, attention_mask, action_mask, normalised state or None)."""
        b = vc.check_obs(obs, self.spec, self.who)
        tasks = vc.get_tasks(obs, b, self.cfg.default_task, self.who)
        ids, valid, act = self._token_rows(tasks)
        st = None
        if self.proprio_projector is not None:
            st = self._normalize(obs[OBS_STATE].to(self.device).float(), "proprio")
        return self._pixels(obs), ids, valid, act, st

    def hidden(self, inputs: tuple) -> torch.Tensor:
        """Hidden states [B, K, D] of the K = chunk x A action positions (adapters folded into
        the weights in eval mode under no_grad, live otherwise)."""
        if self.training or torch.is_grad_enabled() or not self.cfg.fold_lora_for_serving:
            self.lora.unfold()
        else:
            self.lora.fold()
        pix, ids, valid, act, st = inputs
        proprio = None if st is None else self.proprio_projector(st.to(self.proprio_projector.fc1.weight.dtype))
        return self.model.action_hidden(pix, ids, valid, act, proprio)

    def action_hidden(self, obs: Batch) -> torch.Tensor:
        return self.hidden(self.model_inputs(obs))

    def forward_model(self, inputs: tuple) -> torch.Tensor:
        """The bare network on prepared inputs: L1 head -> normalised actions [B, chunk, A];
        discrete head -> tempered action-token logits [B, K, 256]."""
        if (fast := self.fast_path()) is not None:
            return fast.forward(inputs)
        h = self.hidden(inputs)
        if self.action_head is None:
            return self.action_logits(h)
        return self.action_head.predict_action(h.to(self.action_head.model.fc1.weight.dtype))

    def fast_path(self):
        """The fast serving path (agents/policies/openvla_oft/fast.py) when this call may use it, else None."""
        from agents.policies.openvla_oft.fast import fast_path

        return fast_path(self)

    def warm_up(self, batch_sizes=None, *, max_batch: int | None = None) -> dict[int, float]:
        """Compile and capture the serving graphs of ``batch_sizes`` (default
        ``fast_warmup_buckets``) now, not on the first act of each size ({bucket: seconds})."""
        from agents.policies.openvla_oft.fast import warm_up_tasks  # (one per prompt width)

        return warm_up(self, self.fast_path, self.cfg.fast_warmup_buckets if batch_sizes is None else batch_sizes,
                       max_batch=max_batch, tasks=lambda: warm_up_tasks(self))

    # -- heads ------------------------------------------------------------------------------------
    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, K, D] -> tempered logits [B, K, 256] over the action tokens."""
        lo = self.base_vocab - int(self.pcfg.n_action_bins)
        w = self.model.language_model.lm_head.weight[lo:self.base_vocab]
        return F.linear(hidden, w).float() / self.cfg.temperature

    def action_classes(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions [B, H, A] -> action-token classes [B, H*A] (OpenVLA's discretisation)."""
        a = self._normalize(actions.to(self.device).float(), "action").clamp(-1, 1)
        d = torch.bucketize(a, self.bins, right=True)  # np.digitize: 1..256
        return (int(self.pcfg.n_action_bins) - d).clamp(0, int(self.pcfg.n_action_bins) - 1).reshape(a.shape[0], -1)

    def _finish(self, a_norm: torch.Tensor) -> torch.Tensor:
        a = self._normalize(a_norm.float(), "action", inverse=True)
        return a.clamp(-1, 1) if self.cfg.clip_actions else a

    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """Actions [B, chunk, A] float32 (L1 head: deterministic either way, so ``generator``,
        the Policy protocol's, is never drawn from)."""
        if (fast := self.fast_path()) is not None:
            return fast.act(obs, deterministic=deterministic, generator=generator)
        return ActionChunk(self._finish(self.forward_model(self.model_inputs(obs))))

    def extras_spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The L1 head's act is deterministic regression: no extras."""
        return {}

    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """OFT's L1 loss on normalised actions; ``batch["action"]`` [B, A] or [B, <=chunk, A]."""
        target, valid = self._targets(batch)
        pred = self.forward_model(self.model_inputs(batch)).float()
        err = (pred - self._normalize(target, "action")).abs().mean(-1)
        return (err * valid).sum() / valid.sum().clamp_min(1)

    def _targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        act = batch["action"].to(self.device).float()
        act = act[:, None] if act.ndim == 2 else act
        b, h, a = act.shape
        if h > self.chunk_size or a != self.action_dim:
            raise ValueError(f"{self.who}: action must be [B, <= {self.chunk_size}, {self.action_dim}], got {list(act.shape)}")
        valid = torch.zeros(b, self.chunk_size, device=self.device)
        valid[:, :h] = 1
        if "action_is_pad" in batch:
            valid[:, :h] *= (~batch["action_is_pad"].to(self.device).bool()).float()
        return F.pad(act, (0, 0, 0, self.chunk_size - h)), valid

    # -- from scratch (agents/policies/openvla_oft/scratch.py) ------------------------------------------------
    def fit_normalization(self, state, action) -> None:
        """OFT's dataset statistics from data ([N, S], [N, A]): a model trained from scratch has
        none to load; :meth:`save_checkpoint` writes them."""
        from agents.policies.openvla_oft.scratch import fit_stats

        self.stats = fit_stats(state, action)
        self.__dict__.pop("_bounds_cache", None)

    def save_checkpoint(self, path) -> Path:
        """This model in the published layout (``policy.checkpoint`` loads it)."""
        from agents.policies.openvla_oft.scratch import write_checkpoint

        return write_checkpoint(self, path)

    # -- Policy protocol ---------------------------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA adapters + heads only (detached CPU copies)."""
        self.lora.unfold()
        return vc.trainable_state(self)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.lora.unfold()
        vc.load_trainable(self, state, self.who)
        if not self.training and self.cfg.fold_lora_for_serving:
            self.lora.fold()

    def train(self, mode: bool = True):
        super().train(mode)
        if mode:
            self.lora.unfold()
        return self
