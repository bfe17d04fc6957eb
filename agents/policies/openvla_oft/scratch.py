"""OpenVLA-OFT trained from scratch: statistics fitted to demos and a checkpoint in the
published layout, so that SFT of a small OFT hands RL what a downloaded OFT would be.

:func:`fit_stats` computes OFT's ``dataset_statistics.json`` entry (``action`` and
``proprio``: mean, std, min, max, q01, q99, mask; the gripper dimension left unnormalised, as
OFT's LIBERO statistics do) and :func:`write_checkpoint` writes ``config.json``,
``model.safetensors``, ``action_head--<step>_checkpoint.safetensors`` /
``proprio_projector--...``, ``dataset_statistics.json`` and the tokenizer files, which
``policy.checkpoint`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: the dataset_statistics.json key a checkpoint written here uses
STATS_KEY = "tandem_demos"


def fit_stats(state, action) -> dict:
    """OFT's statistics of ``state`` [N, S] and ``action`` [N, A] (the last action dimension,
    the gripper, is masked out of normalisation)."""
    def one(x: np.ndarray, mask: list[bool]) -> dict:
        x = np.asarray(x, np.float64)
        return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(), "min": x.min(0).tolist(),
                "max": x.max(0).tolist(), "q01": np.quantile(x, 0.01, axis=0).tolist(),
                "q99": np.quantile(x, 0.99, axis=0).tolist(), "mask": mask}

    a, s = np.asarray(action), np.asarray(state)
    return {"action": one(a, [True] * (a.shape[1] - 1) + [False]), "proprio": one(s, [True] * s.shape[1]),
            "num_transitions": int(len(a)), "num_trajectories": 0}


def write_checkpoint(policy, path: str | Path, *, step: int = 0) -> Path:
    """``policy`` (an OpenVLA-OFT without LoRA adapters) in the published layout at ``path``."""
    from safetensors.torch import save_file

    if policy.cfg.lora_rank:
        raise ValueError(f"{policy.who}: save_checkpoint writes models without LoRA adapters (lora_rank 0); "
                         f"this one has rank {policy.cfg.lora_rank}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    policy.lora.unfold()
    policy.pcfg.save(path / "config.json")
    save_file({k: v.detach().contiguous().cpu() for k, v in policy.model.state_dict().items()},
              str(path / "model.safetensors"))
    for name in ("action_head", "proprio_projector"):
        mod = getattr(policy, name)
        if mod is not None:
            save_file({f"module.{k}": v.detach().contiguous().cpu() for k, v in mod.state_dict().items()},
                      str(path / f"{name}--{step}_checkpoint.safetensors"))
    (path / "dataset_statistics.json").write_text(json.dumps({STATS_KEY: policy.stats}, indent=1))
    policy.tokenizer.save_pretrained(str(path))
    return path
