"""Success against wall-clock time for a finished comparison (``compare.json``), one column per
setting, one line per run: top, the success rate over the last ``--success-window`` finished
episodes at each episode end; bottom, the learner's updates so far; both from each run's first
env step."""

from __future__ import annotations

import textwrap
from pathlib import Path

STYLE = {"lerobot": {"color": "tab:orange", "ls": "--"}, "tandem": {"color": "tab:blue", "ls": "-"}}


def _success_line(run: dict) -> tuple[list[float], list[float], int]:
    curve = run.get("success_curve") or []
    end = run.get("steady_s", curve[-1][0] if curve else 0.0)
    xs = [0.0] + [c[0] for c in curve] + [end]
    ys = [0.0] + [c[1] for c in curve] + [curve[-1][1] if curve else 0.0]
    return xs, ys, curve[-1][2] if curve else 0


def success_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(res["settings"])
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False, sharex=True)
    window = res["args"]["success_window"]
    for col, setting in enumerate(settings):
        top, bottom = axes[0][col], axes[1][col]
        for side, runs in res["settings"][setting]["runs"].items():
            for i, run in enumerate(runs):
                if "error" in run:
                    continue
                xs, ys, eps = _success_line(run)
                top.step(xs, ys, where="post", lw=1.5, alpha=0.8, **STYLE.get(side, {}),
                         label=f"{side} run {i + 1} ({eps} episodes)")
                up = run.get("updates_curve") or []
                bottom.plot([p[0] for p in up], [p[1] for p in up], drawstyle="steps-post", lw=1.5,
                            alpha=0.8, **STYLE.get(side, {}), label=f"{side} run {i + 1}")
        top.set_title(f"setting: {setting}")
        top.set_ylim(-0.05, 1.05)
        bottom.set_xlabel("seconds since the first env step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel(f"success, last {window} episodes")
    axes[1][0].set_ylabel("learner updates so far")
    title = f"{res.get('task', 'gym-hil PandaPickCube')}: LeRobot HIL-SERL vs Tandem ({res.get('date', '')})"
    fig.suptitle(textwrap.fill(title, 6 + 90 * len(settings) // 2), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
