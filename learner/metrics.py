"""Metrics to the console (one line per period), to ``run_dir/metrics.jsonl`` and to wandb
(offline unless configured).

``metrics.jsonl`` is append-only, one JSON object per logging tick: ``time`` (unix seconds),
``wall_s`` (seconds since this logger started; a resumed run continues from the last line's
value), ``step`` (the step passed to :meth:`MetricsLogger.log`), then every metric whose value
is a number (NaN and infinities are written as null). ``tools/plot_run.py`` reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("tandem.learner")

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> float | int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _last_wall_s(path: Path) -> float:
    """The wall_s of the last complete line of an existing metrics file (0 if none)."""
    if not path.exists():
        return 0.0
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return float(json.loads(line).get("wall_s") or 0.0)
        except (ValueError, AttributeError):
            continue
    return 0.0


class MetricsLogger:
    def __init__(self, *, run_dir: str | Path, wandb_mode: str = "offline", project: str = "tandem",
                 config: Mapping[str, Any] | None = None, name: str | None = None,
                 jsonl: bool = True):
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb must be offline, online or disabled, got {wandb_mode!r}")
        self.run = None
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, mode=wandb_mode, dir=str(run_dir),
                                  config=dict(config or {}), name=name, reinit="finish_previous")
        self.path = Path(run_dir) / METRICS_FILE if jsonl else None
        self._wall0 = _last_wall_s(self.path) if self.path is not None else 0.0
        self._file = self.path.open("a", encoding="utf-8") if self.path is not None else None
        self._t0 = time.monotonic()

    def log(self, metrics: Mapping[str, float], step: int, *, console_keys: list[str] | None = None,
            console: bool = True) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)
        if self._file is not None:
            row: dict[str, Any] = {"time": round(time.time(), 3),
                                   "wall_s": round(self._wall0 + time.monotonic() - self._t0, 3),
                                   "step": int(step)}
            for k, v in metrics.items():
                if k not in row and not isinstance(v, (str, dict, list, tuple)):
                    row[k] = _jsonable(v)
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if not console:
            return
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
        if self._file is not None:
            self._file.close()
            self._file = None


class LoopClock:
    """Where the training loop's time goes in one logging period: ``busy`` (steps that
    updated, sampling included), ``publish_s`` (handing a version to serving and the
    broadcast) and ``checkpoint_s`` (writing checkpoints). ``with clock.timed(key):``
    adds a block's seconds; :meth:`period` returns the figures and starts a new period."""

    KEYS = ("busy", "publish_s", "checkpoint_s")

    def __init__(self):
        self.spent = dict.fromkeys(self.KEYS, 0.0)

    @contextlib.contextmanager
    def timed(self, key: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.spent[key] += time.monotonic() - t0

    def period(self, seconds: float, updates: int) -> dict[str, float]:
        """``train_busy`` (share of the period), ``step_s`` (busy seconds an update, when
        there were updates), ``publish_s`` and ``checkpoint_s`` (seconds in the period)."""
        out = {"train_busy": self.spent["busy"] / seconds if seconds > 0 else 0.0,
               "publish_s": self.spent["publish_s"], "checkpoint_s": self.spent["checkpoint_s"]}
        if updates > 0:
            out["step_s"] = self.spent["busy"] / updates
        self.spent = dict.fromkeys(self.KEYS, 0.0)
        return out
