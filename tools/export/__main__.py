"""``python -m tools.export``: a trained policy -> LeRobot, OpenVLA-OFT or plain-MLP files.

    python -m tools.export --checkpoint runs/exp1 --format lerobot --out export/pi0 \\
        policy=pi0 policy.checkpoint=ckpt/pi0_libero env=libero_spatial
    python -m tools.export --checkpoint sft.safetensors --format openvla_oft --out export/oft \\
        policy=openvla_oft policy.checkpoint=ckpt/oft env=libero_spatial
    python -m tools.export --checkpoint runs/demo --format mlp --out export/mlp   # the demo's SAC run

The Hydra overrides after the flags are the learner's, as the run had them (``policy=``,
``policy.*``, ``env=``): the policy is built from them, then the checkpoint's weights are
loaded into it (a mismatch names the tensors that differ). Add ``policy.device=cpu`` to export
on a machine without the run's GPU. Prints a JSON report (also ``DIR/tandem_export.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from tools.export import FORMATS, ExportError, check_format, export_policy, load_source, prepare_out, resolve


def _with_policy_checkpoint(overrides: list[str], path: str) -> list[str]:
    """A policy checkpoint folder given as --checkpoint is ``policy.checkpoint``."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("policy.checkpoint=")]
    if given and given[-1] != path:
        raise ExportError(f"--checkpoint {path!r} is a policy checkpoint folder but the overrides set "
                          f"policy.checkpoint={given[-1]!r}; give one of them")
    return overrides if given else [*overrides, f"policy.checkpoint={path}"]


def run(args: argparse.Namespace) -> dict:
    from agents.registry import build_policy, policy_class
    from envs.registry import env_spec
    from tools.sft import learner_config

    src = resolve(args.checkpoint)
    overrides = list(args.overrides)
    if src.kind == "policy_checkpoint":
        overrides = _with_policy_checkpoint(overrides, str(src.path))
    try:
        cfg = learner_config(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's errors: unknown group, key or value
        raise ExportError(f"overrides {overrides}: {exc}") from exc
    name = str(cfg.policy.name)
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg.policy, resolve=True)
    check_format(args.format, policy_class(name, values), name)
    prepare_out(args.out, args.overwrite)  # refuse a used folder before building a large model
    policy = build_policy(cfg.policy, env_spec(cfg.env))
    load_source(policy, src)
    options = {"lerobot": {"tokenizer_name": args.tokenizer_name},
               "openvla_oft": {"key": args.unnorm_key, "head_format": args.head_format,
                               "max_shard_size": args.max_shard_size},
               "mlp": {}}[args.format]
    return export_policy(policy, args.format, args.out, source=src, policy_name=name, overwrite=True, **options)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="run directory, learner checkpoint (step_N), trainable-state .safetensors "
                         "(tools/sft.py --out) or policy checkpoint folder (tools/sft.py --save-checkpoint)")
    ap.add_argument("--format", required=True, help=f"one of {', '.join(FORMATS)}")
    ap.add_argument("--out", required=True, help="folder to write (must be empty unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    ap.add_argument("--tokenizer-name", default=None,
                    help="lerobot: the tokenizer the pre-processor names (default lerobot's "
                         "google/paligemma-3b-pt-224; the folder's tokenizer/ is the one Tandem used)")
    ap.add_argument("--unnorm-key", default=None,
                    help="openvla_oft: dataset_statistics.json key (default the policy's unnorm_key)")
    ap.add_argument("--head-format", default="pt", choices=("pt", "safetensors"),
                    help="openvla_oft: head files as .pt (OFT's loader) or .safetensors (Tandem's)")
    ap.add_argument("--max-shard-size", default="5GB", help="openvla_oft: weight shard size (save_pretrained's)")
    ap.add_argument("overrides", nargs="*", help="learner Hydra overrides (policy=..., env=...)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run(args)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    try:
        main()
    except ExportError as exc:
        print(f"export: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
