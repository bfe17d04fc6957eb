"""Plot one or more runs from their ``metrics.jsonl`` (written by the learner every logging tick).

    python -m tools.plot_run runs/demo                       # -> runs/demo/plots/run.png
    python -m tools.plot_run runs/a runs/b --out cmp.png     # overlay two runs

One figure: a row per quantity (success, return, updates/s, losses, policy version lag,
interventions), against env steps (left column) and wall time (right column). Several runs
are overlaid, one colour each, labelled by their folder name. Quantities a run never logged
are skipped; losses are every logged key ending in ``loss`` (log scale when all positive).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

METRICS_FILE = "metrics.jsonl"

#: (row title, keys: the first one a run has is plotted; "*loss" = every key ending in loss)
ROWS = [
    ("success (moving window)", ["success"]),
    ("return (moving window)", ["return"]),
    ("updates / s", ["updates_per_s"]),
    ("losses", ["*loss"]),
    ("policy version lag (max over actors)", ["version_lag"]),
    ("interventions (episodes in the window)", ["interventions"]),
]
X_AXES = [("env_steps", "env steps"), ("wall_s", "wall time (s)")]


def load_metrics(run_dir: Path) -> list[dict]:
    """The run's rows, in order; a torn last line (a killed learner) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise SystemExit(f"{run_dir}: no {METRICS_FILE} (is it a Tandem run_dir? runs from before "
                         "metrics.jsonl existed have only wandb files)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            print(f"{path}:{n + 1}: not JSON, skipped", file=sys.stderr)
            continue
        if isinstance(row, dict):
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path} has no rows yet")
    return rows


def _series(rows: list[dict], x: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        xv, yv = r.get(x), r.get(key)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and math.isfinite(yv):
            xs.append(float(xv))
            ys.append(float(yv))
    return xs, ys


def _keys(rows: list[dict], wanted: list[str]) -> list[str]:
    have = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    if wanted == ["*loss"]:
        return sorted(k for k in have if k.endswith("loss"))
    return [next(k for k in wanted if k in have)] if any(k in have for k in wanted) else []


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d).resolve().name or str(d), load_metrics(Path(d))) for d in run_dirs]
    rows = [(title, keys) for title, keys in ROWS if any(_keys(r, keys) for _, r in runs)]
    fig, axes = plt.subplots(len(rows), len(X_AXES), figsize=(11, 2.3 * len(rows) + 0.6),
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for i, (title, wanted) in enumerate(rows):
        for j, (x, xlabel) in enumerate(X_AXES):
            ax = axes[i][j]
            positive = True
            for n, (name, data) in enumerate(runs):
                for m, key in enumerate(_keys(data, wanted)):
                    xs, ys = _series(data, x, key)
                    if not xs:
                        continue
                    positive &= min(ys) > 0
                    label = name if len(wanted) == 1 and wanted[0] != "*loss" else f"{name}: {key}"
                    ax.plot(xs, ys, styles[m % len(styles)], color=colours[n % len(colours)],
                            label=label, linewidth=1.4)
            if wanted == ["*loss"] and positive and ax.lines:
                ax.set_yscale("log")
            if title.startswith("success"):
                ax.set_ylim(-0.03, 1.03)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(rows) - 1:
                ax.set_xlabel(xlabel)
            if ax.lines and (len(runs) > 1 or wanted == ["*loss"]) and j == 0:
                ax.legend(fontsize=7, loc="best")
    fig.suptitle("Tandem: " + ", ".join(name for name, _ in runs), fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, help="run folders holding metrics.jsonl")
    p.add_argument("--out", type=Path, default=None,
                   help="output PNG (default: FIRST_RUN/plots/run.png, or compare.png for several)")
    args = p.parse_args(argv)
    for d in args.run_dirs:
        if not d.is_dir():
            raise SystemExit(f"{d}: not a folder")
    out = args.out or args.run_dirs[0] / "plots" / ("run.png" if len(args.run_dirs) == 1 else "compare.png")
    plot_runs(args.run_dirs, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
