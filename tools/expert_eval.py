"""Measure a LIBERO suite's scripted expert over its fixed initial states, per task.

Every (task, init state) pair runs once: ``reset(seed=init_state, options={task_id,
init_state})``, then the expert's action (``env.unwrapped.expert_action()``) every step
until success or the suite's time limit (LIBERO's protocol: 50 initial states a task).
Cameras are off (the expert reads the simulator, not images). Tasks are spread over
``--workers`` processes.

    python -m tools.expert_eval --suite libero_spatial --tasks all --init-states 50 \\
        --workers 16 --json runs/expert_spatial.json

Prints a Markdown table (task, success, mean steps of the successes) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Sequence


def run_task(args: tuple[str, int, list[int], dict]) -> dict:
    """Run the expert from each init state of one task; returns its tally."""
    suite, task, inits, env_kw = args
    import numpy as np

    from envs.libero.env import LiberoEnv
    from envs.libero.tasks import SUITE_MAX_STEPS

    random = env_kw.pop("random_starts", False)
    env = LiberoEnv(suite, task, init_state_id="random" if random else None, cameras={}, **env_kw)
    limit = SUITE_MAX_STEPS[suite]
    out = {"task_id": task, "instruction": env.task.language, "episodes": 0, "successes": 0,
           "steps": [], "failed_init_states": []}
    t0 = time.monotonic()
    try:
        for i in inits:
            env.reset(seed=i, options={"task_id": task} if random else {"task_id": task, "init_state": i})
            ok, t = False, 0
            while t < limit and not ok:
                _, _, ok, _, _ = env.step(np.asarray(env.expert_action()))
                t += 1
            out["episodes"] += 1
            out["successes"] += int(ok)
            (out["steps"] if ok else out["failed_init_states"]).append(t if ok else i)
    finally:
        env.close()
    out["success"] = out["successes"] / max(out["episodes"], 1)
    out["mean_steps"] = float(np.mean(out["steps"])) if out["steps"] else None
    out["seconds"] = round(time.monotonic() - t0, 1)
    del out["steps"]
    return out


def evaluate(suite: str, tasks: Sequence[int], init_states: int, workers: int,
             env_kw: dict | None = None) -> dict:
    jobs = [(suite, t, list(range(init_states)), dict(env_kw or {})) for t in tasks]
    ctx = mp.get_context("spawn")   # a fresh GL / MuJoCo state per worker
    with ctx.Pool(min(workers, len(jobs))) as pool:
        per_task = sorted(pool.map(run_task, jobs, chunksize=1), key=lambda r: r["task_id"])
    eps = sum(r["episodes"] for r in per_task)
    wins = sum(r["successes"] for r in per_task)
    return {"suite": suite, "init_states": init_states, "episodes": eps, "success": wins / max(eps, 1),
            "per_task": per_task}


def markdown(report: dict) -> str:
    rows = ["| task | instruction | success | mean steps (successes) |", "|---|---|---|---|"]
    for r in report["per_task"]:
        steps = f"{r['mean_steps']:.0f}" if r["mean_steps"] is not None else "-"
        rows.append(f"| {r['task_id']} | {r['instruction']} | {r['successes']}/{r['episodes']} "
                    f"({100 * r['success']:.0f}%) | {steps} |")
    rows.append(f"| all | | {round(100 * report['success'], 1)}% of {report['episodes']} | |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="libero_spatial")
    ap.add_argument("--tasks", default="all", help="all, or comma-separated task indices")
    ap.add_argument("--init-states", type=int, default=50)
    ap.add_argument("--workers", type=int, default=mp.cpu_count())
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--assets-tarball", default=None, help="LIBERO assets tarball (env.assets_tarball)")
    ap.add_argument("--random-starts", action="store_true",
                    help="placements from LIBERO's sampler (seeds 0..N-1) instead of the fixed init states")
    args = ap.parse_args(argv)
    from envs.libero.tasks import list_tasks

    n = len(list_tasks(args.suite))
    tasks = list(range(n)) if args.tasks == "all" else [int(t) for t in args.tasks.split(",")]
    t0 = time.monotonic()
    kw = {"assets_tarball": args.assets_tarball} if args.assets_tarball else {}
    report = evaluate(args.suite, tasks, args.init_states, args.workers, {**kw, "random_starts": args.random_starts})
    report["starts"] = "sampled placements" if args.random_starts else "fixed init states"
    report["seconds"] = round(time.monotonic() - t0, 1)
    print(markdown(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
