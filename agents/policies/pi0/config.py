"""The configuration of Tandem's PI0 / PI0.5 policy (:mod:`agents.policies.pi0.policy`): every
``policy.*`` setting of ``config/policy/pi0.yaml`` / ``pi05.yaml``, with its validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.policies.fast_common import resolve_compile
from agents.policies.pi0.fast_levers import lever_settings
from agents.policies.pi0.flow_rl_config import validate_flow_config

#: lerobot's small modules trained in full, per variant
_HEADS = {"pi0": ("action_in_proj", "action_out_proj", "state_proj", "action_time_mlp_in", "action_time_mlp_out"),
          "pi05": ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")}


@dataclass
class Pi0PolicyConfig:
    """Tandem's PI0 policy (lerobot's PI0 inside). Sequences are tuples (Hydra lists)."""

    #: "pi0" or "pi05"
    variant: str = "pi0"
    #: local checkpoint folder in lerobot's format (config.json + model.safetensors); None:
    #: random weights (drawn from ``seed``) with the env spec's features
    checkpoint: str | None = None
    #: local tokenizer folder ("builtin": a small BPE built offline, agents/policies/tokenizers.py);
    #: None: ``<checkpoint>/tokenizer``
    tokenizer: str | None = None
    #: actions per query (must equal the checkpoint's chunk_size)
    chunk_size: int = 50
    #: Euler steps of the flow at inference
    num_inference_steps: int = 10
    #: prompt tokens (None: lerobot's default, 48 for PI0 and 200 for PI0.5)
    tokenizer_max_length: int | None = None
    #: prompts padded to the batch's longest rounded up to this (0: to tokenizer_max_length,
    #: lerobot's padding); the output does not depend on it (agents/policies/pi0/prompt.py)
    prompt_pad_multiple: int = 32
    #: square image resolution the model sees (fresh models; a checkpoint has its own)
    image_size: int = 224
    #: reduced sizes (fields of :class:`Pi0Arch`) for a fresh model; a checkpoint's
    #: ``tandem_arch.json`` wins; None: lerobot's standard sizes
    arch: dict | None = None
    #: env camera -> checkpoint image key (None: same names, else sorted order when counts match)
    camera_map: dict | None = None
    #: instruction used for rows whose task is empty (None: an empty task is an error)
    default_task: str | None = None
    #: "auto" (cuda if available) | "cpu" | "cuda" | "cuda:N"
    device: str = "auto"
    #: "auto" (bfloat16 on a GPU, float32 on a CPU) | "bfloat16" | "float32"
    dtype: str = "auto"
    #: LoRA rank (0: no adapters, only the heads train)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    #: Linear layer names that get adapters
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    #: where adapters go: "language_model", "gemma_expert", "vision"
    lora_scopes: tuple[str, ...] = ("language_model", "gemma_expert")
    #: every parameter trains (a model trained from scratch; trainable_state_dict is the whole model)
    train_full: bool = False
    #: modules of lerobot's PI0Pytorch trained in full (those absent in a variant are skipped)
    trainable_heads: tuple[str, ...] = _HEADS["pi0"] + ("time_mlp_in", "time_mlp_out")
    #: clip un-normalised actions to [-1, 1] (Tandem's action space)
    clip_actions: bool = True
    #: eval-mode acts with the adapters folded into the base weights (a copy kept on the device)
    fold_lora_for_serving: bool = True
    #: the serving path of eval-mode ``act`` (agents/policies/pi0/fast.py): "auto" (CUDA graphs
    #: on a GPU, lerobot's sample_actions on a CPU) | "graphs" | "eager" (the fast path without
    #: graphs) | "off" (lerobot's sample_actions always)
    fast_serving: str = "auto"
    #: torch.compile SigLIP, the prefix stack and a denoising step inside the fast path's graphs:
    #: "auto" (where graphs are captured: a GPU) | true | false (pi0_fast.py documents the modes)
    fast_compile: Any = "auto"
    #: batch sizes whose graphs ``warm_up`` compiles and captures before serving (others: lazily)
    fast_warmup_buckets: tuple[int, ...] = (1, 2, 4, 8)
    #: ``warm_up`` also captures every prompt width (``prompt_pad_multiple`` steps) up to this many
    #: token columns, so a longer instruction is not captured on its first act (0: the warm-up task's only)
    fast_warmup_prompt_tokens: int = 64
    #: a folder: the fast path's prefix stages (SigLIP, the VLM stack) compiled ahead of time, loaded
    #: from it by a later start without tracing, else compiled and saved there (agents/policies/fast_aot.py;
    #: opt-in: unlike OFT's, the learner does not set it with its compile artefacts); None: torch.compile only
    fast_aot_dir: str | None = None
    #: the fast path's SigLIP + projector: auto (bf16 on a GPU, else fp32) | fp32 (lerobot's) | bf16 (a copy)
    fast_vision_dtype: str = "auto"
    #: the fast path's expert step linears in FP8 e4m3: false | true (torch._scaled_mm, sm_89+) | emulate (fast_levers.py)
    fast_expert_fp8: Any = False
    #: the fast path's q/k/v and gate/up GEMMs stacked: auto (all on a GPU, else off) | off | expert | all
    fast_fuse_proj: str = "auto"
    #: the fast path's compiles with inductor's GEMM autotuning (Triton templates, fused epilogues; longer compiles)
    fast_autotune: Any = False
    #: the denoising steps' keys/values in per-call buffers, their mask built once a call
    #: (fast_attention.StepKV): auto (on a GPU) | true | false
    fast_step_kv: Any = "auto"
    #: the expert's decoder layers in the denoising steps as Triton kernels (fast_step_layers.py;
    #: needs fast_step_kv): false | true
    fast_step_layers: Any = False
    gradient_checkpointing: bool = False
    #: seed of the random initial weights (both learner copies must agree)
    seed: int = 0
    # -- flow RL (πRL; agents/policies/pi0/flow_rl.py documents the maths) --
    #: None: plain PI0; "noise": Flow-Noise (every Euler step Gaussian); "sde": Flow-SDE (one)
    flow_rl: str | None = None
    #: Flow-Noise: bounds of the noise head's per-step std (normalised action space)
    noise_std_min: float = 0.04
    noise_std_max: float = 0.3
    #: Flow-Noise: hidden width of the noise head (an MLP on the expert's action-token features)
    noise_head_hidden: int = 128
    #: Flow-SDE: the a of sigma_t = a * sqrt(t / (1 - t))
    sde_noise_level: float = 0.5
    #: flow RL: x_0 ~ scale * N(0, I) in stochastic acts (1: lerobot's; 0: fixed start, flow_rl.py)
    init_noise_scale: float = 1.0
    #: value head input: "expert" (the expert's action-token features at t = 1 from zeros; they
    #: see the prefix and, for PI0, the state) or "prefix" (the VLM's prefix features)
    value_features: str = "expert"
    #: hidden width of the value head
    value_hidden: int = 128
    #: the value loss trains the value head only (its input features detached)
    value_detach: bool = True

    def validate(self) -> None:
        if self.fast_serving not in ("auto", "graphs", "eager", "off"):
            raise ValueError(f"policy.fast_serving must be auto, graphs, eager or off, got {self.fast_serving!r}")
        resolve_compile(self.fast_compile, False)  # raises on anything but auto / true / false
        lever_settings(self)  # the fast_* levers (fast_levers.py)
        if self.prompt_pad_multiple < 0:
            raise ValueError(f"policy.prompt_pad_multiple must be >= 0, got {self.prompt_pad_multiple}")
        if self.variant not in ("pi0", "pi05"):
            raise ValueError(f"variant must be pi0 or pi05, got {self.variant!r}")
        if self.chunk_size < 1 or self.num_inference_steps < 1 or self.lora_rank < 0:
            raise ValueError("chunk_size and num_inference_steps must be >= 1, lora_rank >= 0")
        if self.flow_rl is not None:
            validate_flow_config(self)
        known = set(_HEADS["pi0"]) | set(_HEADS["pi05"])
        if set(self.trainable_heads) - known:
            raise ValueError(f"unknown trainable_heads {sorted(set(self.trainable_heads) - known)}; valid: {sorted(known)}")


@dataclass
class Pi05PolicyConfig(Pi0PolicyConfig):
    variant: str = "pi05"
