"""The evaluation report a person reads, written beside ``eval_report.json`` (``mode=eval``):

- ``eval_report.md``: one Markdown table row per task (success, return, episodes) and the
  overall numbers;
- ``eval_report.png``: a bar chart of the success rate per task (matplotlib, headless);
- ``eval_videos/<task>_success.mp4`` and ``..._failure.mp4``: the first successful and the
  first failed episode of each task, when the env has cameras (cameras side by side).

:class:`EvalVideos` collects the frames from the records as they arrive (ingest's records
observer), keeping only episodes that may still be needed.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX

log = logging.getLogger("tandem.learner")

MAX_FRAMES = 2000  # an episode longer than this keeps its first MAX_FRAMES frames


def _slug(task: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", task).strip("_").lower()
    return (s or "default")[:60]


class EvalVideos:
    """Frames of one success and one failure per task (only when the spec has cameras)."""

    def __init__(self, spec, *, fps: float = 10.0):
        self.keys = [OBS_IMAGE_PREFIX + c for c in sorted(spec.cameras)]
        self.fps = fps
        self.open: dict[tuple[str, int], list[np.ndarray]] = {}
        self.kept: dict[tuple[str, bool], list[np.ndarray]] = {}  # (task, success) -> frames
        self._success: dict[tuple[str, int], bool] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def _frame(self, arrays: dict, i: int) -> np.ndarray:
        imgs = [np.asarray(arrays[k][i], np.uint8) for k in self.keys]
        h = max(im.shape[0] for im in imgs)
        imgs = [np.pad(im, ((0, h - im.shape[0]), (0, 0), (0, 0))) for im in imgs]
        return np.concatenate(imgs, axis=1)

    def on_records(self, batch, keep: np.ndarray) -> None:
        if not self.keys:
            return
        a = batch.arrays
        for i in np.flatnonzero(np.asarray(keep, bool)):
            key = (batch.actor_id, int(a["episode"][i]))
            if bool(a["is_last"][i]):
                self.open.pop(key, None)
                continue
            frames = self.open.setdefault(key, [])
            if len(frames) < MAX_FRAMES:
                frames.append(self._frame(a, i))
            self._success[key] = self._success.get(key, False) or bool(a["success"][i])
            if bool(a["terminated"][i]) or bool(a["truncated"][i]):
                task = batch.tasks[i] or "default"
                ok = self._success.pop(key)
                done = self.open.pop(key)
                if (task, ok) not in self.kept:
                    self.kept[(task, ok)] = done
        while len(self.open) > 64:  # abandoned episodes
            self.open.pop(next(iter(self.open)))

    def write(self, out_dir: Path) -> list[Path]:
        paths = []
        for (task, ok), frames in sorted(self.kept.items()):
            path = out_dir / f"{_slug(task)}_{'success' if ok else 'failure'}.mp4"
            try:
                write_video(path, frames, fps=self.fps)
                paths.append(path)
            except Exception as exc:  # pragma: no cover - no encoder: the report still stands
                log.warning("could not write %s: %s", path, exc)
        return paths


def write_video(path: Path, frames: list[np.ndarray], *, fps: float = 10.0) -> None:
    """H.264 mp4 of uint8 HWC RGB frames (odd sizes padded to even)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames[0].shape[:2]
    ph, pw = h + h % 2, w + w % 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height, stream.pix_fmt = pw, ph, "yuv420p"
        for f in frames:
            f = np.pad(f, ((0, ph - h), (0, pw - w), (0, 0)))
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Evaluation of policy version {report['version']}", "",
             f"{report['episodes']} episodes.", "",
             "| task | success | return | episodes |", "|---|---:|---:|---:|"]
    for task, r in report["per_task"].items():
        lines.append(f"| {task.replace('|', '/')} | {r['success']:.2f} | {r['return']:.2f} | "
                     f"{int(r['episodes'])} |")
    o = report.get("overall") or {}
    if "success" in o:
        lines.append(f"| **overall** | **{o['success']:.2f}** | **{o['return']:.2f}** | "
                     f"**{int(o['episodes'])}** |")
    return "\n".join(lines) + "\n"


def bar_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["per_task"])
    succ = [report["per_task"][t]["success"] for t in tasks]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(tasks)), 3.6))
    bars = ax.bar(range(len(tasks)), succ, color="tab:green")
    for b, t in zip(bars, tasks):
        n = int(report["per_task"][t]["episodes"])
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.02, f"{b.get_height():.2f}\n(n={n})",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(tasks)), [t if len(t) <= 24 else t[:22] + "…" for t in tasks],
                  rotation=20 if len(tasks) > 3 else 0, ha="right" if len(tasks) > 3 else "center",
                  fontsize=8)
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("success rate")
    ax.set_title(f"evaluation, policy version {report['version']}, {report['episodes']} episodes",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_eval_report(run_dir: str | Path, report: dict[str, Any], *,
                      videos: EvalVideos | None = None) -> list[Path]:
    """Write the Markdown table, the bar chart and the videos; returns their paths."""
    run_dir = Path(run_dir)
    md = run_dir / "eval_report.md"
    md.write_text(markdown(report))
    png = run_dir / "eval_report.png"
    bar_chart(report, png)
    out = [md, png]
    if videos is not None and videos.enabled:
        out += videos.write(run_dir / "eval_videos")
    return out
