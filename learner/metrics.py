"""Metrics to the console (one line per period) and to wandb (offline unless configured)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("tandem.learner")


class MetricsLogger:
    def __init__(self, *, run_dir: str | Path, wandb_mode: str = "offline", project: str = "tandem",
                 config: Mapping[str, Any] | None = None, name: str | None = None):
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb must be offline, online or disabled, got {wandb_mode!r}")
        self.run = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=project, mode=wandb_mode, dir=str(run_dir),
                                  config=dict(config or {}), name=name, reinit="finish_previous")
        self._t0 = time.monotonic()

    def log(self, metrics: Mapping[str, float], step: int, *, console_keys: list[str] | None = None) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)
        keys = console_keys or list(metrics)
        parts = [f"{time.monotonic() - self._t0:6.0f}s"]
        for k in keys:
            if k in metrics:
                v = metrics[k]
                parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
        log.info(" | ".join(parts))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
