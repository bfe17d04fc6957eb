"""lerobot's PI0 / PI0.5 modules for :mod:`agents.policies.pi0.policy`: importing them (alone when
lerobot's data stack is absent), building them at other sizes than the standard 3B, and writing
checkpoints in lerobot's layout.

lerobot's ``PaliGemmaWithExpertModel`` hard-codes the PaliGemma-3B vocabulary and SigLIP sizes
and takes the Gemma widths from a two-entry table; :func:`build_lerobot_pi` substitutes both,
for that one construction, with the sizes of a :class:`Pi0Arch`, so that test-size models are
the same classes with smaller numbers. With the default :class:`Pi0Arch` nothing is substituted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.policies.pi0")

ARCH_FILE = "tandem_arch.json"
_PATCH_LOCK = threading.Lock()


# -- importing lerobot's PI modules -----------------------------------------------------------
def lerobot_pi_module(variant: str) -> types.ModuleType:
    """``lerobot.policies.pi0.modeling_pi0`` (or ``pi05``).

    When lerobot's package ``__init__`` chain needs something not installed (it imports the
    whole policy zoo and the dataset stack: datasets, pyarrow, av, ...), the two package
    ``__init__`` files are skipped and only the modules PI0 itself needs are loaded.
    """
    name = f"lerobot.policies.{variant}.modeling_{variant}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError as exc:   # ModuleNotFoundError, or lerobot's require_package (e.g. av)
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "lerobot":
            raise
        log.info("lerobot's full import needs %s; importing PI0 modules alone",
                 getattr(exc, "name", None) or exc)
        for mod in [m for m in sys.modules if m == "lerobot.policies" or m.startswith("lerobot.policies.")]:
            del sys.modules[mod]   # the half-imported package chain
    root = Path(importlib.util.find_spec("lerobot").origin).parent
    for pkg, path in (("lerobot.policies", root / "policies"), (f"lerobot.policies.{variant}",
                                                                root / "policies" / variant)):
        if pkg not in sys.modules:
            spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            spec.submodule_search_locations = [str(path)]
            mod = importlib.util.module_from_spec(spec)
            mod.__path__ = [str(path)]
            sys.modules[pkg] = mod
    return importlib.import_module(name)


# -- sizes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pi0Arch:
    """Model sizes. The defaults are lerobot's standard PI0 (gemma_2b VLM, gemma_300m expert,
    SigLIP-So400m/14); smaller values build the same classes at test size. The VLM and the
    expert share depth, heads and head_dim (their attention is joint); lerobot's joint
    attention assumes 8 query heads."""

    width: int = 2048
    depth: int = 18
    mlp_dim: int = 16384
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    expert_width: int = 1024
    expert_mlp_dim: int = 4096
    vocab_size: int = 257152
    vision_width: int = 1152
    vision_depth: int = 27
    vision_heads: int = 16
    vision_mlp_dim: int = 4304
    vision_patch: int = 14

    def __post_init__(self):
        if self.num_heads != 8:
            raise ValueError(f"lerobot's PI0 joint attention assumes 8 heads, got num_heads={self.num_heads}")

    @classmethod
    def from_dict(cls, d: dict | None) -> "Pi0Arch":
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown arch field(s) {unknown}; valid: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)


def _sized_pwe(mod, arch: Pi0Arch):
    """lerobot's PaliGemmaWithExpertModel with every size taken from ``arch`` (its own
    constructor hard-codes the 3B vocabulary and SigLIP sizes)."""
    base = mod.PaliGemmaWithExpertModel

    def __init__(self, vlm_config, action_expert_config, use_adarms=None, precision="bfloat16",
                 image_size=224, freeze_vision_encoder=False, train_expert_only=False):
        nn.Module.__init__(self)
        use_adarms = use_adarms or [False, False]
        self.freeze_vision_encoder, self.train_expert_only = freeze_vision_encoder, train_expert_only
        vlm = mod.CONFIG_MAPPING["paligemma"]()
        vlm._vocab_size = arch.vocab_size  # noqa: SLF001
        vlm.image_token_index = arch.vocab_size
        t = vlm.text_config
        t.hidden_size, t.intermediate_size = vlm_config.width, vlm_config.mlp_dim
        t.num_attention_heads, t.head_dim = vlm_config.num_heads, vlm_config.head_dim
        t.num_hidden_layers, t.num_key_value_heads = vlm_config.depth, vlm_config.num_kv_heads
        t.hidden_activation, t.dtype, t.vocab_size = "gelu_pytorch_tanh", "float32", arch.vocab_size
        t.use_adarms, t.adarms_cond_dim = use_adarms[0], vlm_config.width if use_adarms[0] else None
        v = vlm.vision_config
        v.image_size, v.patch_size, v.hidden_size = image_size, arch.vision_patch, arch.vision_width
        v.num_hidden_layers, v.num_attention_heads = arch.vision_depth, arch.vision_heads
        v.intermediate_size, v.projection_dim = arch.vision_mlp_dim, vlm_config.width
        v.projector_hidden_act, v.dtype = "gelu_fast", "float32"
        vlm.projection_dim = vlm_config.width
        e = action_expert_config
        expert = mod.CONFIG_MAPPING["gemma"](
            head_dim=e.head_dim, hidden_size=e.width, intermediate_size=e.mlp_dim,
            num_attention_heads=e.num_heads, num_hidden_layers=e.depth, num_key_value_heads=e.num_kv_heads,
            vocab_size=arch.vocab_size, hidden_activation="gelu_pytorch_tanh", dtype="float32",
            use_adarms=use_adarms[1], adarms_cond_dim=e.width if use_adarms[1] else None)
        self.paligemma = mod.PaliGemmaForConditionalGenerationWithPiGemma(config=vlm)
        self.gemma_expert = mod.PiGemmaForCausalLM(config=expert)
        self.gemma_expert.model.embed_tokens = None
        self.to_bfloat16_for_selected_params(precision)
        self._set_requires_grad()

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


@contextlib.contextmanager
def _sizes(mod, arch: Pi0Arch):
    if arch == Pi0Arch():
        yield  # lerobot's own sizes: nothing to substitute
        return
    gem = {"gemma_2b": mod.GemmaConfig(arch.width, arch.depth, arch.mlp_dim, arch.num_heads,
                                       arch.num_kv_heads, arch.head_dim),
           "gemma_300m": mod.GemmaConfig(arch.expert_width, arch.depth, arch.expert_mlp_dim, arch.num_heads,
                                         arch.num_kv_heads, arch.head_dim)}
    with _PATCH_LOCK:
        saved = mod.get_gemma_config, mod.PaliGemmaWithExpertModel
        mod.get_gemma_config, mod.PaliGemmaWithExpertModel = gem.__getitem__, _sized_pwe(mod, arch)
        try:
            yield
        finally:
            mod.get_gemma_config, mod.PaliGemmaWithExpertModel = saved


def lerobot_sizes(variant: str, arch: Pi0Arch):
    """A context in which lerobot's own PI0 / PI0.5 classes, ``from_pretrained`` included,
    build at the sizes of ``arch``: how an export of a test-size model loads in lerobot (at
    the standard sizes nothing is substituted)."""
    return _sizes(lerobot_pi_module(variant), arch)


def build_lerobot_pi(variant: str, lr_cfg, arch: Pi0Arch, *, seed: int | None = 0):
    """lerobot's PI0Policy / PI05Policy for ``lr_cfg`` at the sizes of ``arch``; random weights
    drawn from ``seed`` (so that two builds, e.g. the learner's training and serving copies,
    hold the same frozen weights)."""
    mod = lerobot_pi_module(variant)
    cls = mod.PI0Policy if variant == "pi0" else mod.PI05Policy
    if arch != Pi0Arch() and (lr_cfg.paligemma_variant, lr_cfg.action_expert_variant) != ("gemma_2b", "gemma_300m"):
        raise ValueError("a custom Pi0Arch needs paligemma_variant=gemma_2b, action_expert_variant=gemma_300m")
    dev = torch.device(lr_cfg.device or "cpu")
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), _sizes(mod, arch), \
            (torch.device(dev) if dev.type == "cuda" else contextlib.nullcontext()):
        if seed is not None:
            torch.manual_seed(seed)
        return cls(lr_cfg)


def lerobot_config(variant: str, spec: EnvSpec, **fields):
    """A fresh lerobot PI0Config/PI05Config whose features are those of ``spec``."""
    mod = lerobot_pi_module(variant)
    from lerobot.configs import FeatureType, PolicyFeature

    cfg_cls = mod.PI0Config if variant == "pi0" else mod.PI05Config
    feats = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, *spec.cameras[k.split(".")[-1]][:2]))
             for k in spec.image_keys}
    feats[OBS_STATE] = PolicyFeature(type=FeatureType.STATE, shape=(spec.state_dim,))
    out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(spec.action_dim,))}
    return cfg_cls(input_features=feats, output_features=out, **fields)


def save_lerobot_checkpoint(inner, path: str | Path, arch: Pi0Arch, stats: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``inner`` (a lerobot PI policy, without adapters) in lerobot's layout."""
    from safetensors.torch import save_file, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    inner.config._save_pretrained(path)
    save_model(inner, str(path / "model.safetensors"))
    if arch != Pi0Arch():
        (path / ARCH_FILE).write_text(json.dumps(dataclasses.asdict(arch), indent=1))
    if stats:
        save_file({k: v.contiguous() for k, v in stats.items()},
                  str(path / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    return path
