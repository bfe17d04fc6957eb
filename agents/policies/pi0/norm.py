"""PI0's state and action normalisation: lerobot's normaliser maths, the statistics a
checkpoint carries, and statistics fitted to data for a model trained from scratch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data.core.schema import OBS_STATE


def load_stats(ckpt: Path) -> dict[str, torch.Tensor]:
    """The normaliser statistics saved beside a lerobot checkpoint ({} when there are none)."""
    from safetensors.torch import load_file

    files = sorted(ckpt.glob("policy_preprocessor_step_*_normalizer_processor.safetensors")) or \
        sorted(ckpt.glob("*normalizer_processor.safetensors"))
    return {k: v.float() for k, v in load_file(str(files[0])).items()} if files else {}


def fit_stats(state: np.ndarray, action: np.ndarray) -> dict[str, torch.Tensor]:
    """Mean, std, min, max, q01 and q99 of ``state`` [N, S] and ``action`` [N, A], keyed as
    lerobot keys a dataset's statistics (``observation.state.mean``, ``action.q99``, ...)."""
    stats = {}
    for key, x in ((OBS_STATE, np.asarray(state, np.float64)), ("action", np.asarray(action, np.float64))):
        for name, v in (("mean", x.mean(0)), ("std", x.std(0)), ("min", x.min(0)), ("max", x.max(0)),
                        ("q01", np.quantile(x, 0.01, axis=0)), ("q99", np.quantile(x, 0.99, axis=0))):
            stats[f"{key}.{name}"] = torch.as_tensor(v, dtype=torch.float32)
    return stats


class Normalizer:
    """lerobot's normaliser maths (processor/normalize_processor.py) for the state and the
    action, with the statistics cached on the device they are used on."""

    _BOUNDS = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}

    def __init__(self, stats: dict[str, torch.Tensor], modes: dict[str, str]):
        self.stats, self.modes, self._cache = stats, modes, {}

    def _get(self, key: str, device) -> dict[str, torch.Tensor]:
        if (key, device) not in self._cache:
            self._cache[(key, device)] = {k.rsplit(".", 1)[1]: v.to(device) for k, v in self.stats.items()
                                          if k.rsplit(".", 1)[0] == key}
        return self._cache[(key, device)]

    def __call__(self, x: torch.Tensor, key: str, inverse: bool = False) -> torch.Tensor:
        mode = self.modes.get("STATE" if key == OBS_STATE else "ACTION", "IDENTITY")
        s = self._get(key, x.device)
        if mode == "IDENTITY" or not s:
            return x
        if mode == "MEAN_STD":
            return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + 1e-8)
        lo, hi = (s[n] for n in self._BOUNDS[mode])
        den = torch.where(hi == lo, torch.full_like(hi, 1e-8), hi - lo)
        return (x + 1) * den / 2 + lo if inverse else 2 * (x - lo) / den - 1
