"""What ``--checkpoint`` names, and its trained weights loaded into a freshly built policy.

Four kinds of input:

- a **run directory** (``run_dir``: its ``checkpoints/latest``), a **checkpoints folder** (with
  ``latest``) or one **checkpoint** ``step_<N>`` (``state.json`` + ``tensors.safetensors``,
  :mod:`learner.checkpoint`): the policy's tensors are read out of the learner's state
  (``algo/policy`` or ``algo/agent/policy``, whichever the algorithm keeps), nothing else;
- a **safetensors file** of the policy's trainable state (``tools/sft.py --out``, the file
  ``policy.init_trainable`` takes);
- a **policy checkpoint folder** (``config.json`` + weights: ``tools/sft.py --save-checkpoint``
  of a model trained from scratch): it becomes ``policy.checkpoint``.

A learner's policy state is either the policy's whole ``state_dict`` (PPO, SAC) or its
``trainable_state_dict`` (adapters + heads: rejection sampling, noise-space SAC); both load,
anything else is refused with the keys that differ.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from learner.checkpoint import LATEST, STATE, TENSORS, latest_checkpoint

#: where the algorithms keep the policy inside a learner checkpoint's ``algo`` state
POLICY_PATHS = (("algo", "policy"), ("algo", "agent", "policy"))


class ExportError(ValueError):
    """Bad input to the exporter: the message names what is wrong and what would be right."""


@dataclass
class Source:
    #: "learner" (a learner checkpoint), "trainable" (a safetensors file), "policy_checkpoint"
    kind: str
    path: Path
    #: training step (learner updates) the weights come from; 0 when unknown
    step: int = 0


def resolve(path: str | Path) -> Source:
    """Say what ``path`` is (see the module docstring) or raise :class:`ExportError`."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"--checkpoint {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ExportError(f"--checkpoint {str(p)!r} is a file but not a .safetensors trainable state "
                              f"(tools/sft.py --out writes one); a run is a folder")
        return Source("trainable", p)
    if (p / STATE).is_file() and (p / TENSORS).is_file():
        return Source("learner", p, _step(p))
    for root in (p / "checkpoints", p):
        if (root / LATEST).is_file():
            ckpt = latest_checkpoint(root)
            if ckpt is None:
                raise ExportError(f"{str(root / LATEST)!r} names {(root / LATEST).read_text().strip()!r}, "
                                  f"which is not a complete checkpoint ({STATE} + {TENSORS})")
            return Source("learner", ckpt, _step(ckpt))
    if (p / "config.json").is_file():
        return Source("policy_checkpoint", p)
    found = sorted(q.name for q in p.iterdir())[:12]
    raise ExportError(f"--checkpoint {str(p)!r} is neither a run directory (checkpoints/{LATEST}), a learner "
                      f"checkpoint ({STATE} + {TENSORS}), nor a policy checkpoint folder (config.json); "
                      f"it holds {found}")


def _step(ckpt: Path) -> int:
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    return int(m.group(1)) if m else 0


def policy_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The policy's tensors of a learner checkpoint, read without the optimiser state."""
    from safetensors import safe_open

    tree = json.loads((ckpt / STATE).read_text())
    for path in POLICY_PATHS:
        node = tree
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node:
            break
    else:
        raise ExportError(f"{str(ckpt)!r} holds no policy state (looked for {['/'.join(p) for p in POLICY_PATHS]}; "
                          f"its algo state has {sorted(tree.get('algo', {}))})")
    refs = {k: v["__tensor__"] for k, v in node.items() if isinstance(v, dict) and "__tensor__" in v}
    with safe_open(str(ckpt / TENSORS), framework="pt") as f:
        return {k: f.get_tensor(ref) for k, ref in refs.items()}


def load_weights(policy, state: dict[str, torch.Tensor], where: str) -> str:
    """Load ``state`` (the policy's whole state dict or its trainable state) into ``policy``;
    returns which it was. A mismatch names the keys: the usual cause is an override that
    differs from the run's (``policy=``, ``policy.lora_rank``, ``policy.flow_rl``, ...)."""
    policy.train()  # adapters unfolded: the layout both dicts were taken in
    full, trainable = set(policy.state_dict()), set(policy.trainable_state_dict())
    keys = set(state)
    try:
        if keys == full:
            policy.load_state_dict(state, strict=True)
            return "state_dict"
        if keys == trainable:
            policy.load_trainable_state_dict(state)
            return "trainable"
    except (RuntimeError, ValueError) as exc:  # shapes: a different rank, width, action size
        raise ExportError(f"{where} does not fit the policy built from the overrides: {exc}") from exc
    near = full if len(keys & full) > len(keys & trainable) else trainable
    missing, unexpected = sorted(near - keys), sorted(keys - near)
    raise ExportError(f"{where} does not fit the policy built from the overrides: {len(missing)} missing "
                      f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}); pass the "
                      f"run's policy settings (policy=..., policy.lora_rank=..., policy.flow_rl=..., env=...)")


def load_source(policy, src: Source) -> None:
    """Put the trained weights of ``src`` into ``policy`` (a policy checkpoint folder needs
    nothing: it was ``policy.checkpoint`` when the policy was built)."""
    if src.kind == "learner":
        load_weights(policy, policy_state(src.path), f"learner checkpoint {str(src.path)!r}")
    elif src.kind == "trainable":
        from safetensors.torch import load_file

        load_weights(policy, load_file(str(src.path)), f"trainable state {str(src.path)!r}")
