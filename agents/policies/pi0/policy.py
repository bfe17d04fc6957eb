"""PI0 and PI0.5 (Physical Intelligence) as Tandem policies, through lerobot's implementation.

The model is lerobot's own ``PI0Policy`` / ``PI05Policy`` (``lerobot.policies.pi0`` /
``pi05``, lerobot >= 0.5 on stock transformers); this file adds what Tandem needs around it:

- observation mapping: ``observation.images.<cam>`` uint8 [B, H, W, 3] -> float [B, 3, H, W]
  in [0, 1] under the checkpoint's image keys (lerobot resizes-with-pad to its resolution),
  ``observation.state`` [B, S] normalised with the checkpoint's statistics, ``task`` ->
  tokens from a *local* tokenizer folder (PI0: ``task + "\\n"``; PI0.5: the openpi prompt
  with the discretised state);
- ``act(obs) -> ActionChunk`` with actions [B, chunk_size, A] (un-normalised, clipped to
  [-1, 1]); ``deterministic=True`` integrates the flow from zero noise, otherwise from a
  standard normal drawn from ``act(obs, generator=g)``'s generator (torch's global RNG without);
- ``bc_loss(batch)``: lerobot's flow-matching loss (MSE between the predicted and the true
  velocity), padded steps masked out;
- bf16 on a GPU (lerobot's mixed layout: vision tower and norms stay float32);
- LoRA through peft on the language model and the action expert (rank, alpha and target
  modules configurable), the small action/time/state projections trained in full, and an
  adapter-only ``trainable_state_dict`` (what Tandem syncs to actors);
- loading a local checkpoint in lerobot's format: ``config.json`` + ``model.safetensors``
  (+ optional ``*normalizer_processor.safetensors`` statistics, + ``tandem_arch.json`` for
  the reduced sizes of test models, + ``tokenizer/``);
- real-time chunking: ``act(obs, rtc=RtcRows)`` freezes each row's delayed steps to its pending
  prefix and guides the rest toward it, always on the fast path (:mod:`agents.policies.pi0.rtc`);
- serving: in eval mode ``act`` runs with the adapters folded into the base weights
  (:class:`agents.policies.vla_common.LoRAServing`; the model is kernel-launch bound at small
  batches and the adapter path nearly doubles PI0's latency); training, ``bc_loss`` and
  ``trainable_state_dict`` unfold them.

Plain PI0 cannot give a log-probability or a reparameterised sample (it is a flow-matching
model), so it is a BCPolicy only (:mod:`agents.base`); pairing it with SAC fails at start-up.
With ``flow_rl=noise|sde`` the config builds the flow-RL variant of
:mod:`agents.policies.pi0.flow_rl` instead (log-probs of the denoising chain, a value head and a
reference: what PPO needs).
Its extra is ``noise`` [B, chunk_size, max_action_dim]: the flow's starting sample, so a
chunk can be replayed exactly (zeros when deterministic).

Sizes: lerobot builds the standard PaliGemma-3B (gemma_2b + SigLIP-So400m) and gemma_300m
action expert. A :class:`Pi0Arch` with other sizes (tests, smoke benches) builds the same
classes with smaller widths/depths by substituting lerobot's size table for that build.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch
from agents.policies import vla_common as vc
from agents.policies.fast_common import prompt_width_tasks, resolve_compile, warm_up
from agents.policies.pi0.fast import FastPiSampler
from agents.policies.pi0.config import _HEADS, Pi0PolicyConfig, Pi05PolicyConfig  # noqa: F401 - re-exported
from agents.policies.pi0.fast_levers import check_levers, lever_settings
from agents.policies.pi0.norm import Normalizer, fit_stats, load_stats
from agents.policies.pi0.prompt import PromptTokens, prompts
from agents.policies.pi0.rtc import RtcRows, hold_frozen, rtc_inputs
from agents.policies.pi0.lerobot_modules import (ARCH_FILE, Pi0Arch, build_lerobot_pi, lerobot_config,  # noqa: F401
                                         lerobot_pi_module, save_lerobot_checkpoint)
from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.policies.pi0")

#: vocabulary of the builtin tokenizer (at most the model's)
BUILTIN_VOCAB = 400

_LORA_SCOPES = {
    "language_model": r"model\.paligemma_with_expert\.paligemma\.model\.language_model",
    "gemma_expert": r"model\.paligemma_with_expert\.gemma_expert\.model",
    "vision": r"model\.paligemma_with_expert\.paligemma\.model\.vision_tower",
}


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# -- policy -----------------------------------------------------------------------------------
class Pi0Policy(nn.Module):
    """PI0 / PI0.5 behind :class:`agents.base.Policy` (see the module docstring)."""

    #: the fast serving path's class (flow RL's adds its chain)
    _fast_class = FastPiSampler
    #: the prefix stages' ahead-of-time functions are opt-in (``policy.fast_aot_dir``): not yet
    #: measured on a GPU, so the learner does not turn them on with its compile artefacts
    AOT_BY_DEFAULT = False
    #: the ``deterministic`` flags of the acts ``warm_up`` runs per bucket (plain PI0's graph is
    #: the same for both: the flag only sets the noise)
    _warm_acts = (True,)

    def __init__(self, cfg: Pi0PolicyConfig, spec: EnvSpec):
        super().__init__()
        cfg.validate()
        self.cfg, self.spec, self.variant = cfg, spec, cfg.variant
        self.who = f"policy={'pi05' if cfg.variant == 'pi05' else 'pi0'}"
        self.chunk_size, self.action_dim = int(cfg.chunk_size), spec.action_dim
        dev = vc.resolve_device(cfg.device)
        dtype = vc.resolve_dtype(cfg.dtype, dev)
        check_levers(cfg, dev, self.who)  # FP8 that cannot run here fails now
        ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
        lr_cfg, arch, self.stats = self._config(ckpt, dev, dtype)
        self.cam_keys = self._camera_keys(lr_cfg)  # spec image key -> lerobot image key
        self.inner = build_lerobot_pi(cfg.variant, lr_cfg, arch, seed=cfg.seed)
        if ckpt is not None:
            self._load_weights(ckpt)
        self.lr_cfg, self.arch = lr_cfg, arch
        self.norm = Normalizer(self.stats, {k: getattr(v, "value", str(v)) for k, v in lr_cfg.normalization_mapping.items()})
        tok = cfg.tokenizer or (str(ckpt / "tokenizer") if ckpt else None)
        if tok is None:
            raise ValueError(f"{self.who}: set policy.tokenizer (a local tokenizer folder) or a checkpoint with tokenizer/")
        self.tokenizer = vc.load_local_tokenizer(tok, self.who, builtin=("gemma", min(BUILTIN_VOCAB, arch.vocab_size)))
        if len(self.tokenizer) > arch.vocab_size:
            raise ValueError(f"{self.who}: tokenizer has {len(self.tokenizer)} tokens, model vocabulary {arch.vocab_size}")
        self.prompt_tokens = PromptTokens(self.tokenizer, int(lr_cfg.tokenizer_max_length), cfg.prompt_pad_multiple)
        if cfg.lora_rank > 0:
            regex = vc.lora_regex(_LORA_SCOPES, cfg.lora_scopes, cfg.lora_target_modules)
            vc.add_lora(self.inner, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                        target_regex=regex)
        heads = ["model"] if cfg.train_full else \
            [f"model.{h}" for h in cfg.trainable_heads if h in _HEADS[cfg.variant]]
        vc.set_trainable(self.inner, heads)
        self.inner.to(dev)
        self.lora = vc.LoRAServing(self.inner)

    # -- construction helpers -------------------------------------------------------------------
    def _config(self, ckpt: Path | None, dev: torch.device, dtype: torch.dtype):
        cfg, spec = self.cfg, self.spec
        precision = "bfloat16" if dtype == torch.bfloat16 else "float32"
        if ckpt is None:
            arch = Pi0Arch.from_dict(cfg.arch)
            extra = {"tokenizer_max_length": cfg.tokenizer_max_length} if cfg.tokenizer_max_length else {}
            lr_cfg = lerobot_config(cfg.variant, spec, chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size,
                                    image_resolution=(cfg.image_size, cfg.image_size), device=dev.type,
                                    dtype=precision, **extra)
            stats = {}
        else:
            if not (ckpt / "config.json").is_file() or not (ckpt / "model.safetensors").is_file():
                raise vc.CheckpointMismatch(
                    f"{self.who}: {str(ckpt)!r} is not a lerobot checkpoint folder (needs config.json and "
                    f"model.safetensors; found {sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else 'no folder'})")
            kind = json.loads((ckpt / "config.json").read_text()).get("type")
            if kind != cfg.variant:
                raise vc.CheckpointMismatch(f"{self.who}: checkpoint {str(ckpt)!r} is of type {kind!r}, "
                                            f"this policy loads {cfg.variant!r} checkpoints")
            lerobot_pi_module(cfg.variant)
            from lerobot.configs import PreTrainedConfig

            lr_cfg = PreTrainedConfig.from_pretrained(str(ckpt))
            arch_file = ckpt / ARCH_FILE
            arch = Pi0Arch.from_dict(json.loads(arch_file.read_text())) if arch_file.exists() else Pi0Arch()
            if lr_cfg.chunk_size != cfg.chunk_size:
                raise ValueError(f"{self.who}: checkpoint predicts chunks of {lr_cfg.chunk_size} actions; "
                                 f"set policy.chunk_size={lr_cfg.chunk_size}")
            a = lr_cfg.output_features["action"].shape[0]
            if a != spec.action_dim:
                raise ValueError(f"{self.who}: checkpoint outputs {a}-D actions, the env has {spec.action_dim}")
            st = lr_cfg.input_features.get(OBS_STATE)
            if st is not None and st.shape[0] != spec.state_dim:
                raise ValueError(f"{self.who}: checkpoint expects a {st.shape[0]}-D state, the env has {spec.state_dim}")
            lr_cfg.device, lr_cfg.dtype = dev.type, precision
            if cfg.tokenizer_max_length:
                lr_cfg.tokenizer_max_length = cfg.tokenizer_max_length
            stats = load_stats(ckpt)
        lr_cfg.num_inference_steps = cfg.num_inference_steps
        lr_cfg.gradient_checkpointing = cfg.gradient_checkpointing
        return lr_cfg, arch, stats

    def _camera_keys(self, lr_cfg) -> dict[str, str]:
        model_keys = list(lr_cfg.image_features)
        env_keys = self.spec.image_keys
        if self.cfg.camera_map:
            m = {f"observation.images.{a}": (b if b.startswith("observation.") else f"observation.images.{b}")
                 for a, b in self.cfg.camera_map.items()}
        elif set(env_keys) == set(model_keys):
            m = {k: k for k in env_keys}
        elif len(env_keys) == len(model_keys):
            m = dict(zip(env_keys, sorted(model_keys)))
            log.info("%s: env cameras -> checkpoint images by sorted order: %s", self.who, m)
        else:
            raise ValueError(f"{self.who}: the model expects {len(model_keys)} camera image(s) {model_keys}, the env "
                             f"has {len(env_keys)} {env_keys}; set policy.camera_map")
        if sorted(m) != sorted(env_keys) or not set(m.values()) <= set(model_keys):
            raise ValueError(f"{self.who}: camera_map {m} must map the env cameras {env_keys} onto {model_keys}")
        return m

    def _load_weights(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        quiet = _DropRecords("Vision embedding key might need handling")  # lerobot warns for every SigLIP
        logging.getLogger().addFilter(quiet)
        try:
            sd = self.inner._fix_pytorch_state_dict_keys(load_file(str(ckpt / "model.safetensors")), self.inner.config)
        finally:
            logging.getLogger().removeFilter(quiet)
        sd = {k if k.startswith("model.") else f"model.{k}": v for k, v in sd.items()}
        expected = self.inner.state_dict()
        by_ptr: dict[int, list[str]] = {}
        for k, v in expected.items():
            by_ptr.setdefault(v.data_ptr(), []).append(k)
        tied = {k for ks in by_ptr.values() if len(ks) > 1 for k in ks}
        vc.check_state_layout(expected, sd, repr(str(ckpt)), f"the {self.variant} architecture of its config",
                              optional=tied)
        self.inner.load_state_dict(sd, strict=False)

    # -- from scratch ------------------------------------------------------------------------------
    def fit_normalization(self, state, action) -> None:
        """Set the state and action statistics (mean, std, min, max, q01, q99) from data
        ([N, S], [N, A]), as lerobot computes a dataset's: a model trained from scratch has no
        checkpoint to read them from. :meth:`save_checkpoint` writes them."""
        self.stats = fit_stats(state, action)
        self.norm = Normalizer(self.stats, self.norm.modes)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write this model as a lerobot-layout checkpoint (config.json, model.safetensors,
        tandem_arch.json, normaliser statistics, tokenizer/) that ``policy.checkpoint`` loads:
        what SFT of a model trained from scratch hands to RL. Needs a model without adapters."""
        if self.cfg.lora_rank:
            raise ValueError(f"{self.who}: save_checkpoint writes models without LoRA adapters "
                             f"(lora_rank 0); this one has rank {self.cfg.lora_rank}")
        import shutil

        out = save_lerobot_checkpoint(self.inner, path, self.arch, self.stats)
        if (out / "tokenizer").exists():
            shutil.rmtree(out / "tokenizer")
        self.tokenizer.save_pretrained(str(out / "tokenizer"))
        return out

    # -- observation mapping ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.inner.model.action_out_proj.weight.device

    def lerobot_batch(self, obs: Batch, *, full_prompt: bool = False, frames: bool = False) -> dict[str, Any]:
        """Tandem observation -> the batch lerobot's PI0Policy reads (tokens included; padded to
        lerobot's length with ``full_prompt``, else only as far as ``prompt_pad_multiple`` says).
        ``frames``: the cameras' frames as they came, on the device (:meth:`_frames_to_model`
        maps them)."""
        b = vc.check_obs(obs, self.spec, self.who)
        tasks = vc.get_tasks(obs, b, self.cfg.default_task, self.who)
        dev = self.device
        out: dict[str, Any] = {}
        for k, lk in self.cam_keys.items():
            out[lk] = obs[k].to(dev, non_blocking=True)
            if not frames:
                out[lk] = self._frame(out[lk])
        state = self.norm(obs[OBS_STATE].to(dev).float(), OBS_STATE)
        out[OBS_STATE] = state
        out["observation.language.tokens"], out["observation.language.attention_mask"] = self.prompt_tokens(
            prompts(self.variant, tasks, state), dev, full=full_prompt)
        return out

    @staticmethod
    def _frame(x: torch.Tensor) -> torch.Tensor:
        """A camera's frames [B, H, W, C] in 0..255 -> [B, C, H, W] in [0, 1] (lerobot's layout)."""
        return x.permute(0, 3, 1, 2).float().div_(255.0)

    def _frames_to_model(self, frames: list[torch.Tensor]) -> tuple[list, list]:
        """The cameras' frames (``lerobot_batch(frames=True)``, in ``cam_keys`` order) -> the
        images and masks lerobot's PI0Pytorch takes (lerobot's own preprocessing)."""
        return self.inner._preprocess_images({lk: self._frame(f) for lk, f in zip(self.cam_keys.values(), frames)})

    def model_inputs(self, obs: Batch) -> tuple:
        """The tensors lerobot's PI0Pytorch takes (images, masks, tokens, [state])."""
        return self._model_inputs(self.lerobot_batch(obs))

    def forward_model(self, inputs: tuple, noise: torch.Tensor | None = None, rtc: RtcRows | None = None,
                      frames: bool = False) -> torch.Tensor:
        """The bare model call: [B, chunk, max_action_dim]. Lerobot's PI0Pytorch.sample_actions,
        or in eval mode without gradients its fast equivalent (``fast_serving``; always with
        ``rtc``, :mod:`agents.policies.pi0.rtc`: eager where no graphs are captured). ``frames``:
        ``inputs`` hold the cameras' frames (no masks), mapped inside the fast path's graph."""
        self._serving_weights()
        fast = self._fast_sampler(force=rtc is not None)
        if frames and fast is None:
            inputs = (*self._frames_to_model(inputs[0]), *inputs[2:])
        if fast is None:
            return self.inner.model.sample_actions(*inputs, noise=noise)
        if noise is None:
            noise = torch.randn(inputs[2].shape[0], self.chunk_size, int(self.lr_cfg.max_action_dim),
                                device=self.device)
        images, img_masks, toks, masks = inputs[:4]
        state = inputs[4] if len(inputs) > 4 else None
        steps = int(self.lr_cfg.num_inference_steps)
        extra = {} if rtc is None else rtc_inputs(rtc, lambda a: self.norm(a, "action"), self.chunk_size,
                                                   int(self.lr_cfg.max_action_dim), steps, self.device)
        return fast.sample(images, img_masks, toks, masks, state, noise.to(self.device, torch.float32),
                           steps, key=self.lora.folded, prep=self._frames_to_model if frames else None, **extra)

    def _fast_sampler(self, force: bool = False):
        mode = self.cfg.fast_serving
        if not force and (mode == "off" or self.training or torch.is_grad_enabled()):
            return None
        cuda = self.device.type == "cuda"
        if mode == "auto" and not cuda and not force:
            return None
        if getattr(self, "_fast", None) is None:
            g = cuda and mode in ("auto", "graphs")
            self._fast = self._fast_class(self.inner.model, self.variant, graphs=g, compile=resolve_compile(
                self.cfg.fast_compile, g), aot_dir=self.cfg.fast_aot_dir, **lever_settings(self.cfg, cuda))
        return self._fast

    def warm_up(self, batch_sizes=None, *, max_batch: int | None = None) -> dict[int, float]:
        """Compile and capture the serving graphs of ``batch_sizes`` (default
        ``fast_warmup_buckets``) now, not on the first act of each size ({bucket: seconds})."""
        return warm_up(self, self._fast_sampler, self.cfg.fast_warmup_buckets if batch_sizes is None
                       else batch_sizes, max_batch=max_batch, acts=self._warm_acts, tasks=self.warm_up_tasks)

    def warm_up_tasks(self) -> list[str]:
        """One task per prompt width the warm-up captures (``fast_warmup_prompt_tokens``)."""
        base = self.cfg.default_task or "warm up"
        limit = int(self.cfg.fast_warmup_prompt_tokens)
        if limit <= 0:
            return [base]
        state, cpu = torch.zeros(1, self.spec.state_dim), torch.device("cpu")

        def columns(task: str) -> int:
            return int(self.prompt_tokens(prompts(self.variant, [task], state), cpu)[0].shape[1])

        return prompt_width_tasks(columns, min(limit, self.prompt_tokens.max_len), base=base)

    def _serving_weights(self) -> None:
        """Adapters folded into the weights in eval mode without gradients, live otherwise."""
        if self.training or torch.is_grad_enabled() or not self.cfg.fold_lora_for_serving:
            self.lora.unfold()
        else:
            self.lora.fold()

    def _model_inputs(self, lb: dict, frames: bool = False) -> tuple:
        if frames:  # the cameras' frames as they came (lerobot_batch(frames=True)), no masks yet
            images, img_masks = [lb[lk] for lk in self.cam_keys.values()], None
        else:
            images, img_masks = self.inner._preprocess_images(lb)
        toks, masks = lb["observation.language.tokens"], lb["observation.language.attention_mask"]
        if self.variant == "pi0":
            return images, img_masks, toks, masks, self.inner.prepare_state(lb)
        return images, img_masks, toks, masks

    # -- Policy protocol ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False, noise: torch.Tensor | None = None,
            rtc: RtcRows | None = None, generator: torch.Generator | None = None) -> ActionChunk:
        """Actions [B, chunk_size, A] float32; ``noise`` [B, chunk_size, max_action_dim] overrides
        the flow's starting sample (deterministic: zeros; otherwise drawn from ``generator``, or
        torch's global RNG when None). ``rtc``: each row's pending prefix and delay
        (:mod:`agents.policies.pi0.rtc`; its frozen steps are returned as sent)."""
        # what lerobot's predict_action_chunk does, minus its eval(); where the fast path serves, the
        # cameras' frames go to it as they came and their preprocessing runs inside its graph
        self._serving_weights()
        frames = self._fast_sampler(force=rtc is not None) is not None
        inputs = self._model_inputs(self.lerobot_batch(obs, frames=frames), frames)
        shape = (inputs[2].shape[0], self.chunk_size, self.lr_cfg.max_action_dim)
        if noise is None:
            noise = (torch.zeros(shape, device=self.device) if deterministic
                     else torch.randn(shape, device=self.device, generator=generator))
        noise = noise.to(self.device, torch.float32)
        actions = self._postprocess(self.forward_model(inputs, noise, rtc, frames))
        return ActionChunk(actions if rtc is None else hold_frozen(actions, rtc), None, {"noise": noise})

    @property
    def noise_shape(self) -> tuple[int, int]:
        """(chunk_size, max_action_dim): one chunk's starting noise (NoiseConditionedPolicy)."""
        return (self.chunk_size, int(self.lr_cfg.max_action_dim))

    def extras_spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``noise``: the flow's starting sample of each chunk."""
        return {"noise": ("float32", (self.chunk_size, int(self.lr_cfg.max_action_dim)))}

    def _postprocess(self, actions: torch.Tensor) -> torch.Tensor:
        a = self.norm(actions[..., :self.action_dim].float(), "action", inverse=True)
        return a.clamp(-1.0, 1.0) if self.cfg.clip_actions else a

    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """Flow-matching loss on ``batch["action"]`` ([B, A], [B, h, A] with h <= chunk_size, or
        [B, chunk_size, A]); steps past h or flagged by ``action_is_pad`` [B, h] are ignored."""
        self.lora.unfold()
        lb = self.lerobot_batch(batch)
        act = batch["action"].to(self.device).float()
        act = act[:, None] if act.ndim == 2 else act
        b, h, a = act.shape
        if h > self.chunk_size or a != self.action_dim:
            raise ValueError(f"{self.who}: action must be [B, <= {self.chunk_size}, {self.action_dim}], got {list(act.shape)}")
        valid = torch.ones(b, self.chunk_size, device=self.device)
        valid[:, h:] = 0
        if "action_is_pad" in batch:
            valid[:, :h] *= (~batch["action_is_pad"].to(self.device).bool()).float()
        act = self.norm(act, "action")
        act = F.pad(act, (0, self.lr_cfg.max_action_dim - a, 0, self.chunk_size - h))
        model = self.inner.model
        noise, time = model.sample_noise(act.shape, act.device), model.sample_time(b, act.device)
        inputs = self._model_inputs(lb)
        losses = model.forward(*inputs, act, noise, time)[:, :, :a]  # [B, chunk, A]
        return (losses.mean(-1) * valid).sum() / valid.sum().clamp_min(1.0)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA adapters + trained heads only (detached CPU copies), keyed by module path."""
        self.lora.unfold()
        return vc.trainable_state(self.inner)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.lora.unfold()
        vc.load_trainable(self.inner, state, self.who)
        if not self.training:
            self._serving_weights()

    def train(self, mode: bool = True):
        super().train(mode)  # lerobot's modules keep their frozen parts in eval themselves
        if mode:
            self.lora.unfold()
        return self


class Pi05Policy(Pi0Policy):
    """PI0.5: the same wrapper over lerobot's PI05Policy (state goes into the prompt)."""
