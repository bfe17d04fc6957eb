"""OpenVLA-OFT -> the folder OpenVLA-OFT's evaluation and deploy code loads
(``experiments/robot/openvla_utils.py`` of moojink/openvla-oft: ``get_vla``,
``get_action_head``, ``get_proprio_projector``, ``get_processor``).

Written:

- ``config.json`` (``model_type: openvla``, ``auto_map`` to OFT's ``configuration_prismatic`` /
  ``modeling_prismatic``, the Prismatic fields incl. ``vision_backbone_id`` /
  ``llm_backbone_id`` where the backbone is one OFT knows, ``norm_stats``) and the VLA's
  weights as ``save_pretrained`` writes them: ``model.safetensors``, or
  ``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json`` past
  ``max_shard_size`` (huggingface_hub's writer), LoRA merged into the base weights;
- ``action_head--<step>_checkpoint.pt`` (L1 head only) and ``proprio_projector--<step>_checkpoint.pt``:
  OFT finds them with ``find_checkpoint_file`` (exactly one file per component) and reads
  them with ``torch.load(weights_only=True)``, so they are ``.pt`` files: ``torch.save`` of a
  plain dict of tensors under OFT's DDP ``module.`` prefix. ``head_format="safetensors"``
  writes ``.safetensors`` instead, which Tandem loads and OFT's loader does not;
- ``dataset_statistics.json`` ``{unnorm_key: {"action": ..., "proprio": ...}}``;
- the tokenizer files and ``preprocessor_config.json`` / ``processor_config.json`` (OFT's
  ``PrismaticImageProcessor`` settings). OFT's ``get_vla`` copies its ``modeling_prismatic.py``
  and ``configuration_prismatic.py`` into a local checkpoint folder itself; ``get_processor``
  (``trust_remote_code``) also needs OFT's ``processing_prismatic.py`` copied beside them.

OFT's evaluation settings that match this policy (``center_crop``, ``num_images_in_input``,
``use_proprio``, ``unnorm_key``, ``lora_rank=0``: merged) are in ``tandem_export.json``. Tandem
clamps the head's normalised output to [-1, 1] before un-normalising and the action to [-1, 1]
after; OFT's ``predict_action`` does neither.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tools.export.source import ExportError

log = logging.getLogger("tandem.tools.export")

AUTO_MAP = {"AutoConfig": "configuration_prismatic.OpenVLAConfig",
            "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction"}
#: OFT's configuration_prismatic.py: vision_backbone_id -> (timm ids, image sizes), for the ids
#: an OpenVLA-OFT checkpoint can have
OFT_BACKBONES = {
    "dinosiglip-vit-so-224px": (("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"), (224, 224)),
    "dinosiglip-vit-so-384px": (("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_384"), (384, 384)),
    "siglip-vit-so400m": (("vit_so400m_patch14_siglip_224",), (224,)),
    "dinov2-vit-l": (("vit_large_patch14_reg4_dinov2.lvd142m",), (224,)),
}


def unnorm_key(policy, given: str | None) -> str:
    """The dataset_statistics.json key: ``given``, else the policy's ``unnorm_key``, else the
    only key of its checkpoint's statistics, else Tandem's key for fitted statistics."""
    from agents.policies.openvla_oft.scratch import STATS_KEY

    if given or policy.cfg.unnorm_key:
        return given or policy.cfg.unnorm_key
    f = Path(policy.cfg.checkpoint or "") / "dataset_statistics.json"
    keys = list(json.loads(f.read_text())) if policy.cfg.checkpoint and f.is_file() else []
    return keys[0] if len(keys) == 1 else STATS_KEY


def oft_config(policy, key: str, dtype: torch.dtype) -> dict:
    """config.json: the policy's Prismatic config with what OFT's OpenVLAConfig reads."""
    d = policy.pcfg.to_dict()
    d["auto_map"] = dict(AUTO_MAP)
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    d["norm_stats"] = {key: policy.stats} if policy.stats else None
    d.setdefault("llm_max_length", 2048)
    d.setdefault("output_projector_states", False)
    pc = policy.pcfg
    if "vision_backbone_id" not in d:
        n = 2 if pc.use_fused_vision_backbone else 1
        want = (tuple(pc.timm_model_ids[:n]), tuple(pc.image_sizes[:n]))
        vid = next((k for k, v in OFT_BACKBONES.items() if v == want), None)
        if vid is None or pc.tandem_timm_overrides:
            log.warning("config.json gets no vision_backbone_id: timm %s at %s%s is no backbone OFT's "
                        "OpenVLAConfig knows; the export loads in Tandem, not in OFT's code", want[0], want[1],
                        " with test-size overrides" if pc.tandem_timm_overrides else "")
        else:
            d["vision_backbone_id"] = vid
            d.setdefault("llm_backbone_id", "llama2-7b-pure")
    return d


def processor_configs(policy) -> tuple[dict, dict]:
    """preprocessor_config.json and processor_config.json as OFT's processor writes them."""
    pc, vb = policy.pcfg, policy.model.vision_backbone
    n = len(vb.pixel_stats)
    pre = {"auto_map": {"AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
                        "AutoProcessor": "processing_prismatic.PrismaticProcessor"},
           "image_processor_type": "PrismaticImageProcessor", "processor_class": "PrismaticProcessor",
           "image_resize_strategy": pc.image_resize_strategy, "use_fused_vision_backbone": pc.use_fused_vision_backbone,
           "input_sizes": [[3, s, s] for s in pc.image_sizes[:n]], "interpolations": ["bicubic"] * n,
           "means": [list(m) for m, _ in vb.pixel_stats], "stds": [list(s) for _, s in vb.pixel_stats]}
    proc = {"auto_map": {"AutoProcessor": "processing_prismatic.PrismaticProcessor"}, "processor_class": "PrismaticProcessor"}
    return pre, proc


def export_openvla_oft(policy, out: Path, *, step: int = 0, key: str | None = None, head_format: str = "pt",
                       max_shard_size: str | int = "5GB") -> dict:
    """Write ``policy`` (a Tandem OpenVLA-OFT, L1 or discrete head) in OFT's layout at ``out``."""
    from huggingface_hub import save_torch_state_dict

    from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy

    if not isinstance(policy, OpenVLAOFTPolicy):
        raise ExportError(f"--format openvla_oft writes OpenVLA-OFT policies; this is {type(policy).__name__}")
    if head_format not in ("pt", "safetensors"):
        raise ExportError(f"--head-format must be pt (what OFT's loader reads) or safetensors, got {head_format!r}")
    key = unnorm_key(policy, key)
    dtype = policy.model.projector.fc1.weight.dtype
    policy.lora.fold()  # the adapters merged into the base weights, peft's wrappers swapped out
    try:
        sd = {k: v.detach().contiguous() for k, v in policy.model.state_dict().items()}
        left = [k for k in sd if ".lora_" in k or ".base_layer." in k]
        if left:
            raise ExportError(f"{policy.who}: LoRA adapters could not be merged ({left[:3]})")
        save_torch_state_dict(sd, str(out), max_shard_size=max_shard_size, metadata={"format": "pt"})
    finally:
        policy.lora.unfold()
    del sd
    heads = {}
    for name in ("action_head", "proprio_projector"):
        mod = getattr(policy, name)
        if mod is None:
            continue
        hsd = {f"module.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in mod.state_dict().items()}
        path = out / f"{name}--{step}_checkpoint.{head_format}"
        if head_format == "pt":
            torch.save(hsd, path)  # plain tensors: OFT reads it with torch.load(weights_only=True)
        else:
            from safetensors.torch import save_file

            save_file(hsd, str(path))
        heads[name] = path.name
    (out / "config.json").write_text(json.dumps(oft_config(policy, key, dtype), indent=2))
    if policy.stats:
        (out / "dataset_statistics.json").write_text(json.dumps({key: policy.stats}, indent=2))
    else:
        log.warning("%s has no dataset statistics: OFT's predict_action cannot un-normalise its actions", policy.who)
    pre, proc = processor_configs(policy)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2))
    policy.tokenizer.save_pretrained(str(out))
    cfg = policy.cfg
    return {"loader": "OpenVLA-OFT get_vla / get_action_head / get_proprio_projector (experiments/robot/openvla_utils.py)",
            "heads": heads, "unnorm_key": key, "dtype": str(dtype).removeprefix("torch."),
            "merged_lora_layers": len(policy.lora.sites),
            "oft_eval_settings": {"use_l1_regression": policy.action_head is not None, "use_diffusion": False,
                                  "use_proprio": policy.proprio_projector is not None, "center_crop": cfg.center_crop,
                                  "num_images_in_input": len(policy.cams), "unnorm_key": key, "lora_rank": 0,
                                  "camera_order": [c.split(".")[-1] for c in policy.cams],
                                  "normalization": cfg.normalization}}
