"""Export a trained Tandem policy in the format another stack loads.

    python -m tools.export --checkpoint RUN_OR_CKPT --format lerobot|openvla_oft|mlp --out DIR \\
        [hydra overrides: policy=pi0 policy.checkpoint=... env=... as the run had them]

- ``lerobot`` (PI0 / PI0.5): a LeRobot policy folder, :mod:`tools.export.lerobot_pi`;
- ``openvla_oft``: OpenVLA-OFT's checkpoint folder, :mod:`tools.export.openvla_oft`;
- ``mlp``: model.safetensors + config.json, :mod:`tools.export.mlp`.

What ``--checkpoint`` may be: :mod:`tools.export.source`. Every export also writes
``tandem_export.json`` (format, policy, source, step, and which loader reads the folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tools.export.source import ExportError, Source, load_source, resolve  # noqa: F401

#: format -> (module, writer, the policy class it takes as "module:Class")
FORMATS = {
    "lerobot": ("tools.export.lerobot_pi", "export_lerobot", "agents.policies.pi0.policy:Pi0Policy"),
    "openvla_oft": ("tools.export.openvla_oft", "export_openvla_oft", "agents.policies.openvla_oft.policy:OpenVLAOFTPolicy"),
    "mlp": ("tools.export.mlp", "export_mlp", "agents.policies.mlp:MLPPolicy"),
}
#: the format each policy class exports to (for error messages)
FORMAT_OF = {"Pi0Policy": "lerobot", "OpenVLAOFTPolicy": "openvla_oft", "MLPPolicy": "mlp"}


def _import(path: str):
    import importlib

    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


def check_format(fmt: str, policy_cls: type, policy_name: str) -> None:
    """Refuse an unknown format, or a format that this policy class has no export to, before
    any model is built."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown --format {fmt!r}; choose one of {sorted(FORMATS)}")
    if not issubclass(policy_cls, _import(FORMATS[fmt][2])):
        fits = next((f for base in policy_cls.__mro__ if (f := FORMAT_OF.get(base.__name__))), None)
        hint = f"; policy={policy_name} exports with --format {fits}" if fits else \
            f"; policy={policy_name} has no export format"
        raise ExportError(f"--format {fmt} exports {FORMATS[fmt][2].split(':')[1]} policies, not "
                          f"{policy_cls.__name__}{hint}")


def prepare_out(out: str | Path, overwrite: bool = False) -> Path:
    """``out`` as an empty folder (an existing non-empty one only with ``overwrite``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {str(out)!r} is not empty; pass --overwrite to write into it")
    out.mkdir(parents=True, exist_ok=True)
    return out


def export_policy(policy, fmt: str, out: str | Path, *, source: Source | None = None, policy_name: str = "",
                  overwrite: bool = False, **options) -> dict:
    """Write ``policy`` in format ``fmt`` into ``out``; returns what was written (also saved as
    ``tandem_export.json``). ``options`` go to the format's writer (``tokenizer_name``;
    ``key``, ``head_format``, ``max_shard_size``, ``step``)."""
    check_format(fmt, type(policy), policy_name or type(policy).__name__)
    out = prepare_out(out, overwrite)
    module, writer, _ = FORMATS[fmt]
    if fmt == "openvla_oft":
        options.setdefault("step", source.step if source else 0)
    info = _import(f"{module}:{writer}")(policy, out, **options)
    report = {"format": fmt, "policy": policy_name or type(policy).__name__,
              "source": str(source.path) if source else None, "source_kind": source.kind if source else None,
              "step": source.step if source else None, **info, "files": sorted({"tandem_export.json", *(p.name for p in out.iterdir())})}
    (out / "tandem_export.json").write_text(json.dumps(report, indent=2))
    _readable(out)
    return report


def _readable(out: Path) -> None:
    """safetensors writes its files 0600; give every file the umask's usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o666 & ~umask)
