"""Success against wall-clock time for a finished comparison (``compare.json``), one panel per
setting, one line per run: the success rate over the last ``--success-window`` finished
episodes at each episode end, from each run's first env step."""

from __future__ import annotations

from pathlib import Path

COLORS = {"lerobot": "tab:orange", "tandem": "tab:blue"}


def success_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(res["settings"])
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False, sharey=True)
    window = res["args"]["success_window"]
    for ax, setting in zip(axes[0], settings):
        for side, runs in res["settings"][setting]["runs"].items():
            for i, run in enumerate(runs):
                curve = run.get("success_curve") or []
                xs = [0.0] + [c[0] for c in curve] + [run.get("steady_s", curve[-1][0] if curve else 0.0)]
                ys = [0.0] + [c[1] for c in curve] + [curve[-1][1] if curve else 0.0]
                eps = curve[-1][2] if curve else 0
                ax.step(xs, ys, where="post", color=COLORS.get(side), alpha=0.8, lw=1.5,
                        label=f"{side} run {i + 1} ({eps} episodes)")
        ax.set_title(f"setting: {setting}")
        ax.set_xlabel("seconds since the first env step")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel(f"success, last {window} episodes")
    fig.suptitle(f"gym-hil PandaPickCube, LeRobot HIL-SERL vs Tandem ({res.get('date', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
