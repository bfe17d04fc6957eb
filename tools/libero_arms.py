"""Compare the arms of launch/libero_two_gpu.sh (one GPU against two ways of using a second one)
from the files each arm's RL run leaves in ``$R/res``: ``<arm>_metrics.jsonl`` (the learner's
metrics, one line per logging tick), ``<arm>_status.json`` (its final status), and when they
exist ``<arm>_gpu.csv`` (nvidia-smi every 5 s: timestamp, GPU index, utilisation, memory) and
``<arm>_actor_lines.txt`` (each actor's last log line).

    python -m tools.libero_arms --res /tmp/lr/res --arms one a b --out /tmp/lr/res/arms
    # -> arms.json and arms.md; the first arm is the baseline unless --baseline names another

Per arm:

- **env steps/s** and **updates/s**: the change of ``env_steps`` / ``updates`` from the first
  to the last metrics line, over the wall time between them (the learner's ``wall_s``, which
  starts when it serves, before its actors connect);
- **act p50 / p99** (ms): the learner's, over every act of the run and every actor
  (``status.json``: receipt of the request to the reply's hand-over, serving's own time;
  learner/actor_stats.py); beside it, when the actors' lines exist, the median over actors of
  each actor's round-trip p50 and the largest of their p99s (the round trip adds the network,
  the wire gate and decoding);
- **time to the baseline's final success**: the target is the baseline arm's last moving
  success of the training episodes (``success``: the window of ``logging.stats_window``
  episodes per task) and its ``interventions`` then (episodes the expert corrected in the
  actors' windows); an arm reaches it at the first line whose success is at least the target
  with no more interventions than the baseline's last line had, from the line where the
  corrected episodes in the windows peak on (a window still full of, or still filling with, the
  expert's corrections does not count as the policy's success). None: not reached;
- GPU utilisation (mean, per GPU index) and the most memory used, over the arm's run, from
  its GPU log.

Only the standard library: it runs with the box's own python3 before or without the kit.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

ACTOR_LINE = re.compile(r"run p50 ([\d.]+), p99 ([\d.]+)")


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, in order; a torn last line is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def rate(rows: list[dict], key: str) -> float | None:
    """(last - first) of ``key`` over (last - first) ``wall_s``, between the first and the last
    row holding both."""
    have = [r for r in rows if _num(r.get(key)) is not None and _num(r.get("wall_s")) is not None]
    if len(have) < 2:
        return None
    dt = float(have[-1]["wall_s"]) - float(have[0]["wall_s"])
    return (float(have[-1][key]) - float(have[0][key])) / dt if dt > 0 else None


def final_success(rows: list[dict]) -> tuple[float | None, int]:
    """The last row's moving success and its interventions (0 when not logged)."""
    for r in reversed(rows):
        s = _num(r.get("success"))
        if s is not None:
            return s, int(_num(r.get("interventions")) or 0)
    return None, 0


def time_to(rows: list[dict], target: float, max_interventions: int) -> float | None:
    """The first ``wall_s`` at which ``success`` >= ``target`` with at most ``max_interventions``
    corrected episodes in the actors' windows, counted from the line where those corrected episodes
    peak: before it the windows are still filling with the expert's corrections (9 episodes, all
    corrected, 10 s into a run, hold nothing of the policy's own). None if never."""
    lines = [(float(r["wall_s"]), s, int(_num(r.get("interventions")) or 0))
             for r in rows if (s := _num(r.get("success"))) is not None and _num(r.get("wall_s")) is not None]
    if not lines:
        return None
    peak = max(range(len(lines)), key=lambda k: (lines[k][2], -k))   # the first line at the most
    for t, s, iv in lines[peak:]:
        if s >= target - 1e-12 and iv <= max_interventions:
            return t
    return None


def gpu_use(path: Path) -> dict | None:
    """Mean utilisation (%) per GPU index and the most memory (MiB) any used, from nvidia-smi's
    ``timestamp, index, utilization.gpu, memory.used`` CSV lines (no header)."""
    if not path.exists():
        return None
    util: dict[str, list[float]] = {}
    mem = 0.0
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if len(row) < 4:
                continue
            idx = row[1].strip()
            try:
                u = float(row[2].strip().split()[0])
                m = float(row[3].strip().split()[0])
            except (ValueError, IndexError):
                continue
            util.setdefault(idx, []).append(u)
            mem = max(mem, m)
    if not util:
        return None
    return {"util_mean_pct": {k: round(statistics.fmean(v), 1) for k, v in sorted(util.items())},
            "samples": {k: len(v) for k, v in sorted(util.items())}, "memory_max_mib": mem}


def actor_latency(path: Path) -> dict | None:
    """From each actor's last log line: the median of their round-trip p50s and the largest p99."""
    if not path.exists():
        return None
    pairs = [(float(m.group(1)), float(m.group(2))) for m in map(ACTOR_LINE.search, path.read_text().splitlines())
             if m]
    if not pairs:
        return None
    return {"actors": len(pairs), "round_trip_p50_ms_median": round(statistics.median(p for p, _ in pairs), 2),
            "round_trip_p99_ms_max": round(max(q for _, q in pairs), 2)}


def arm_figures(res: Path, arm: str) -> dict:
    rows = read_metrics(res / f"{arm}_metrics.jsonl")
    st_path = res / f"{arm}_status.json"
    st = json.loads(st_path.read_text()) if st_path.exists() else {}
    last = rows[-1] if rows else {}
    success, interventions = final_success(rows)

    def pick(key):  # the run's figure: the final status, else the last metrics line
        v = st.get(key, last.get(key))
        return _num(v)

    out = {
        "arm": arm, "lines": len(rows),
        "wall_s": _num(last.get("wall_s")),
        "env_steps": pick("env_steps"), "updates": pick("updates"), "version": pick("version"),
        "episodes": pick("episodes"),
        "env_steps_per_s": rate(rows, "env_steps"), "updates_per_s": rate(rows, "updates"),
        "act_p50_ms": pick("act_p50_ms"), "act_p99_ms": pick("act_p99_ms"), "acts_timed": pick("acts_timed"),
        "final_success": success, "final_interventions": interventions,
        "gpu": gpu_use(res / f"{arm}_gpu.csv"),
        "actor_round_trip": actor_latency(res / f"{arm}_actor_lines.txt"),
    }
    return out


def compare(res: Path, arms: list[str], baseline: str | None = None) -> dict:
    baseline = baseline or arms[0]
    figs = {a: arm_figures(res, a) for a in arms}
    base = figs[baseline]
    target, max_int = base["final_success"], base["final_interventions"]
    for a in arms:
        f = figs[a]
        rows = read_metrics(res / f"{a}_metrics.jsonl")
        f["time_to_target_s"] = None if target is None else time_to(rows, target, max_int)
        for k in ("env_steps_per_s", "updates_per_s"):
            b, v = base.get(k), f.get(k)
            f[k.replace("_per_s", "_vs_baseline")] = round(v / b, 3) if v is not None and b else None
    return {"baseline": baseline, "target_success": target, "target_max_interventions": max_int,
            "arms": [figs[a] for a in arms]}


def _fmt(v, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def markdown(result: dict, names: dict[str, str] | None = None) -> str:
    names = names or {}
    lines = [f"Baseline: arm `{result['baseline']}`; target: its final moving success "
             f"{_fmt(result['target_success'], '.3f')} with at most {result['target_max_interventions']} "
             "corrected episodes in the actors' windows.", "",
             "| arm | what | env steps/s | updates/s | act p50 ms | act p99 ms | actor round trip p50 / p99 ms "
             "| time to target s | final success | GPU util % (by index) | GPU mem max MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in result["arms"]:
        rt = f.get("actor_round_trip") or {}
        gpu = f.get("gpu") or {}
        util = " / ".join(f"{k}: {v:.0f}" for k, v in (gpu.get("util_mean_pct") or {}).items()) or "-"

        def vs(key, per_s):
            x, r = f.get(per_s), f.get(key)
            return _fmt(x) + (f" ({r:.2f}x)" if r is not None and f["arm"] != result["baseline"] else "")

        lines.append(
            f"| {f['arm']} | {names.get(f['arm'], '')} | {vs('env_steps_vs_baseline', 'env_steps_per_s')} "
            f"| {vs('updates_vs_baseline', 'updates_per_s')} | {_fmt(f['act_p50_ms'])} | {_fmt(f['act_p99_ms'])} "
            f"| {_fmt(rt.get('round_trip_p50_ms_median'))} / {_fmt(rt.get('round_trip_p99_ms_max'))} "
            f"| {_fmt(f['time_to_target_s'], '.0f')} | {_fmt(f['final_success'], '.3f')} | {util} "
            f"| {_fmt(gpu.get('memory_max_mib'), '.0f')} |")
    return "\n".join(lines) + "\n"


#: what each arm of launch/libero_two_gpu.sh runs
ARM_NAMES = {"one": "everything on GPU 0", "a": "train GPU 0, serve GPU 1",
             "b": "ZeRO-2 on GPUs 0+1, serve GPU 0"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--res", required=True, type=Path, help="the folder holding <arm>_metrics.jsonl etc. ($R/res)")
    ap.add_argument("--arms", nargs="+", default=["one", "a", "b"])
    ap.add_argument("--baseline", default=None, help="the arm the others are compared with (default: the first)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md (default: RES/arms)")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms if (args.res / f"{a}_metrics.jsonl").exists()]
    missing = [a for a in args.arms if a not in arms]
    if not arms:
        sys.exit(f"no <arm>_metrics.jsonl in {args.res} for arms {args.arms}")
    baseline = args.baseline or arms[0]
    result = compare(args.res, arms, baseline)
    result["missing_arms"] = missing
    out = args.out or args.res / "arms"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = markdown(result, ARM_NAMES)
    if missing:
        md += f"\nMissing (no metrics): {', '.join(missing)}\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
