"""The table of the pre-registered rejection-sampling runs (docs/preregistered.md, claim 2)
from the ``results.jsonl`` that :mod:`tools.experiments.rs_vl_learning` appends to::

    python -m tools.experiments.rs_vl_report /tmp/rs_vl/results.jsonl
    python -m tools.experiments.rs_vl_report --arm rs_expert /tmp/c7/results.jsonl   # claim 7

A seed passes when its RS run's held-out success after the cycles is at least ``LIFT`` above
its start and at least ``OVER_CONTROL`` above the same seed's demos-only control after; the
claim holds when at least ``NEED`` seeds pass.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LIFT = 0.10
OVER_CONTROL = 0.10
NEED = 4


def load(path: str | Path) -> dict[tuple[str, int], dict]:
    """{(arm, seed): the run's summary}; a later line for the same run replaces an earlier one."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[(r["arm"], int(r["seed"]))] = r
    return out


def seed_passes(rs: dict, demos: dict) -> bool:
    return rs["after"] >= rs["start"] + LIFT - 1e-9 and rs["after"] >= demos["after"] + OVER_CONTROL - 1e-9


def table(runs: dict[tuple[str, int], dict], arm: str = "rs") -> tuple[str, int, int]:
    """A markdown table (one row per seed that has both ``arm`` and the demos-only control), the
    passes and the seeds. ``arm``: ``rs`` (claims 2 and 5) or ``rs_expert`` (claim 7)."""
    rows = ["| seed | untrained | RS start | RS after | demos-only start | demos-only after | "
            "RS online episodes (kept) | wall s RS / demos | load (1-min) RS | pass |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    passes = n = 0
    for seed in sorted({s for _, s in runs}):
        rs, dm = runs.get((arm, seed)), runs.get(("demos", seed))
        if rs is None or dm is None:
            continue
        ok = seed_passes(rs, dm)
        passes, n = passes + ok, n + 1
        rows.append(f"| {seed} | {rs['untrained']:.2f} | {rs['start']:.2f} | {rs['after']:.2f} | "
                    f"{dm['start']:.2f} | {dm['after']:.2f} | {rs['online_episodes']} ({rs['kept_episodes']}) | "
                    f"{rs['wall_s']:.0f} / {dm['wall_s']:.0f} | {min(rs['load_1min']):.1f}-{max(rs['load_1min']):.1f} | "
                    f"{'yes' if ok else 'no'} |")
    return "\n".join(rows), passes, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--arm", default="rs", choices=["rs", "rs_expert"],
                    help="the arm measured against the demos-only control (rs_expert: claim 7)")
    args = ap.parse_args(argv)
    text, passes, n = table(load(args.results), args.arm)
    print(text)
    print(f"\npass {passes}/{n} (claim holds: {passes >= NEED and n >= 5})")


if __name__ == "__main__":
    main()
