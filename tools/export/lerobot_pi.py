"""PI0 / PI0.5 -> a LeRobot policy folder that ``PI0Policy.from_pretrained`` / ``PI05Policy.
from_pretrained`` and ``lerobot.policies.factory.make_pre_post_processors`` load.

Written (lerobot 0.6's layout, by lerobot's own writers):

- ``config.json`` + ``model.safetensors``: ``PreTrainedPolicy.save_pretrained`` of the lerobot
  model Tandem trains, with the LoRA adapters merged into the base weights (W0 + scale B A, in
  float32, cast to the weight's dtype: what Tandem serves) and no adapter tensors left;
- ``policy_preprocessor.json`` / ``policy_postprocessor.json`` and their
  ``*_normalizer_processor.safetensors`` / ``*_unnormalizer_processor.safetensors``: lerobot's
  own PI0 / PI0.5 processor factory with the policy's state and action statistics; an env
  camera that Tandem maps onto another image key (``policy.camera_map``) goes into the rename
  step. The tokenizer step names ``tokenizer_name`` (default lerobot's,
  ``google/paligemma-3b-pt-224``); offline, or for a model with another tokenizer, load with
  ``preprocessor_overrides={"tokenizer_processor": {"tokenizer_name": f"{dir}/tokenizer"}}``;
- ``tokenizer/``: the tokenizer Tandem used, and ``tandem_arch.json`` for reduced (test) sizes,
  so that the folder is also a Tandem ``policy.checkpoint``.

Not exported: the flow-RL heads (noise and value heads of ``policy.flow_rl``; the deployed
policy is the plain flow, as Tandem's deterministic act). Tandem clips actions to its [-1, 1]
action space after un-normalising; lerobot's post-processor does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
from pathlib import Path

from tools.export.source import ExportError

log = logging.getLogger("tandem.tools.export")

#: the tokenizer lerobot's PI0 / PI0.5 processors name
LEROBOT_TOKENIZER = "google/paligemma-3b-pt-224"
#: PaliGemma's vocabulary: a tokenizer of another size is not the one lerobot's name loads
PALIGEMMA_VOCAB = 257152


@contextlib.contextmanager
def _local_tokenizer(tokenizer):
    """lerobot's processor factory loads its tokenizer by hub name while building the
    pipeline; inside this block that load returns ``tokenizer`` (the export never reaches a
    hub). The name stays in the step's config, which is what gets saved."""
    import lerobot.processor.tokenizer_processor as tp

    class _Local:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return tokenizer

    saved = tp.AutoTokenizer
    tp.AutoTokenizer = _Local
    try:
        yield
    finally:
        tp.AutoTokenizer = saved


def _nested_stats(flat: dict) -> dict | None:
    """Tandem's ``observation.state.mean`` -> lerobot's ``{"observation.state": {"mean": ...}}``."""
    out: dict = {}
    for key, value in flat.items():
        feature, stat = key.rsplit(".", 1)
        out.setdefault(feature, {})[stat] = value.float().cpu()
    return out or None


def processors(policy, tokenizer_name: str | None = None):
    """lerobot's pre- and post-processor pipelines for ``policy`` (its config, statistics,
    camera renames and tokenizer name)."""
    from lerobot.processor import RenameObservationsProcessorStep, TokenizerProcessorStep

    v = policy.variant
    make = getattr(importlib.import_module(f"lerobot.policies.{v}.processor_{v}"), f"make_{v}_pre_post_processors")
    with _local_tokenizer(policy.tokenizer):
        pre, post = make(policy.lr_cfg, dataset_stats=_nested_stats(policy.stats))
    for step in pre.steps:
        if isinstance(step, RenameObservationsProcessorStep):
            step.rename_map = {k: lk for k, lk in policy.cam_keys.items() if k != lk}
        if isinstance(step, TokenizerProcessorStep) and tokenizer_name:
            step.tokenizer_name = tokenizer_name
    return pre, post


def export_lerobot(policy, out: Path, *, tokenizer_name: str | None = None) -> dict:
    """Write ``policy`` (a Tandem PI0 / PI0.5) as a LeRobot policy folder at ``out``."""
    from agents.policies.pi0.policy import Pi0Arch, Pi0Policy

    if not isinstance(policy, Pi0Policy):
        raise ExportError(f"--format lerobot writes PI0 / PI0.5 policies; this is {type(policy).__name__}")
    if not tokenizer_name and abs(len(policy.tokenizer) - PALIGEMMA_VOCAB) > 1024:
        log.warning("the policy's tokenizer has %d tokens, not PaliGemma's: load the processors with "
                    "preprocessor_overrides={'tokenizer_processor': {'tokenizer_name': '%s/tokenizer'}} "
                    "(or export with --tokenizer-name)", len(policy.tokenizer), out)
    inner = policy.inner
    policy.lora.fold()  # the adapters merged into the base weights, peft's wrappers swapped out
    try:
        left = [k for k in inner.state_dict() if ".lora_" in k or ".base_layer." in k]
        if left:
            raise ExportError(f"{policy.who}: LoRA adapters could not be merged ({left[:3]})")
        inner.save_pretrained(out)  # lerobot's writer: config.json + model.safetensors
    finally:
        policy.lora.unfold()
    pre, post = processors(policy, tokenizer_name)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    policy.tokenizer.save_pretrained(str(out / "tokenizer"))
    if policy.arch != Pi0Arch():
        from agents.policies.pi0.lerobot_modules import ARCH_FILE

        (out / ARCH_FILE).write_text(json.dumps(dataclasses.asdict(policy.arch), indent=1))
    name = next(s.tokenizer_name for s in pre.steps if hasattr(s, "tokenizer_name"))
    return {"loader": f"lerobot {type(inner).__name__}.from_pretrained + make_pre_post_processors",
            "tokenizer_name": name, "merged_lora_layers": len(policy.lora.sites)}
