"""End-to-end throughput run: one learner and N actor processes on this machine (loopback),
for a fixed time, with what an operator asks of a deployment measured from outside.

The learner and actors are the products' own entry points (``python -m learner``,
``python -m actor``) with the Hydra overrides given here. Every ``--sample-s`` seconds the
learner's ``status.json`` is read and, on an NVIDIA machine, ``nvidia-smi`` is asked for the
GPU's utilisation and memory. The steady window starts at the first ingested env step (start-up
excluded) and ends with the run. Reported (``<out>/e2e.json``, also printed):

- ``env_steps_per_s``: env steps the learner ingested per second of the steady window;
- ``chunks_served_per_s`` and ``mean_served_batch``: act requests answered per second, and
  requests per inference batch, over the window;
- ``update_s``: the on-policy learner's time in ``agent.update`` for each round that updated
  (from ``metrics.jsonl``, one entry per round that a logging tick saw), median and all;
- ``version_lag``: the policy-version lag of the rollouts each round trained on (current version
  minus the oldest version that acted in an episode: ``round_version_lag_mean/max``);
- ``gpu_util_pct``: nvidia-smi's utilisation, mean and median over the window's samples;
- per actor: steps/s and act p50 from the learner's view.

    python -m tools.bench.e2e_run --out runs/e2e --actors 14 --minutes 5 \\
        --common env=libero_spatial env.task_id=all \\
        --learner algo=grpo policy=openvla_oft_discrete device=cuda \\
        --actor env.gl=egl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.experiments.learning_run import free_port, stop_processes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def gpu_sample() -> dict[str, float] | None:
    """One nvidia-smi reading of GPU 0 (utilisation %, memory used MiB), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                              "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        util, mem = (float(x) for x in out.split(",")[:2])
        return {"util_pct": util, "mem_mib": mem}
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _rate(a: dict, b: dict, key: str) -> float | None:
    if key not in a or key not in b or b["t"] <= a["t"]:
        return None
    return (float(b[key]) - float(a[key])) / (b["t"] - a["t"])


def summarize(samples: list[dict], metrics: list[dict], actors: list[dict], t_first: float | None,
              wall: float) -> dict:
    """The report's figures from the status samples (steady window: from ``t_first``)."""
    win = [s for s in samples if t_first is not None and s["t"] >= t_first]
    out: dict = {"wall_s": round(wall, 1), "steady_s": round(win[-1]["t"] - win[0]["t"], 1) if len(win) > 1 else 0.0,
                 "samples": len(win)}
    if len(win) > 1:
        a, b = win[0], win[-1]
        out["env_steps_per_s"] = _rate(a, b, "env_steps")
        out["episodes_per_s"] = _rate(a, b, "episodes")
        out["chunks_served_per_s"] = _rate(a, b, "served")
        batches = float(b.get("infer_batches", 0)) - float(a.get("infer_batches", 0))
        out["mean_served_batch"] = ((float(b["served"]) - float(a["served"])) / batches
                                    if batches > 0 and "served" in b else None)
        out["updates"] = int(b.get("updates", 0)) - int(a.get("updates", 0))
        out["env_steps"], out["episodes"], out["version"] = (b.get("env_steps"), b.get("episodes"),
                                                              b.get("version"))
    utils = [s["gpu"]["util_pct"] for s in win if s.get("gpu")]
    mems = [s["gpu"]["mem_mib"] for s in win if s.get("gpu")]
    if utils:
        out["gpu_util_pct"] = {"mean": float(np.mean(utils)), "median": float(np.median(utils)),
                               "samples": len(utils)}
        out["gpu_mem_mib_max"] = float(max(mems))
    by_round: dict[float, dict] = {}  # a logging tick repeats the last round's figures
    for m in metrics:
        if "rounds" in m and m.get("round_episodes", 0):
            by_round[float(m["rounds"])] = m
    rounds = [by_round[k] for k in sorted(by_round)]
    ups = [float(m["update_s"]) for m in rounds if "update_s" in m]
    if ups:
        out["update_s"] = {"median": float(np.median(ups)), "all": [round(x, 2) for x in ups]}
    if rounds:
        lag = [float(m["round_version_lag_mean"]) for m in rounds if "round_version_lag_mean" in m]
        lmax = [float(m["round_version_lag_max"]) for m in rounds if "round_version_lag_max" in m]
        if lag:
            out["version_lag"] = {"mean": float(np.mean(lag)), "max": float(max(lmax))}
        out["round_episodes"] = [int(m["round_episodes"]) for m in rounds]
        out["round_success"] = [round(float(m.get("round_success", 0)), 3) for m in rounds]
    out["actors"] = [{k: r.get(k) for k in ("actor", "connected", "steps_per_s", "act_p50_ms", "episodes")}
                     for r in actors]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new folder for the run, logs and e2e.json")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=5.0, help="steady window (start-up excluded)")
    ap.add_argument("--startup-timeout-s", type=float, default=600.0,
                    help="give up when no env step arrives within this long")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--common", nargs="*", default=[], help="overrides for learner and actors")
    ap.add_argument("--learner", nargs="*", default=[], help="learner overrides")
    ap.add_argument("--actor", nargs="*", default=[], help="actor overrides")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    run_dir = out / "run"
    port, pub, act = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    common = [*args.common, f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              f"transport.act_port={act}"]
    procs: list[subprocess.Popen] = []

    def start(module: str, name: str, extra: list[str], penv: dict) -> None:
        f = open(out / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", module, *common, *extra], cwd=ROOT, env=penv,
                             stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        p.name = name  # type: ignore[attr-defined]
        procs.append(p)

    t0 = time.monotonic()
    every = [] if any(o.startswith("logging.every_s=") for o in args.learner) else [
        f"logging.every_s={min(5.0, args.sample_s)}"]  # status.json as often as it is sampled
    start("learner", "learner", ["logging.wandb=disabled", *every, *args.learner], env)
    actor_env = {**env, "OMP_NUM_THREADS": "1"}
    for i in range(args.actors):
        start("actor", f"actor{i:02d}", [f"actor_id=a{i:02d}", "log_every_s=30", f"seed={1000 * (i + 1)}",
                                       *args.actor], actor_env)
    samples: list[dict] = []
    t_first: float | None = None
    status: dict = {}
    try:
        while procs[0].poll() is None:
            time.sleep(args.sample_s)
            now = time.monotonic() - t0
            status = read_json(run_dir / "status.json")
            try:  # the learner writes it between rounds: date the figures by the file's age
                age = max(0.0, time.time() - (run_dir / "status.json").stat().st_mtime)
            except FileNotFoundError:
                age = 0.0
            s = {"t": now - age, **{k: status[k] for k in ("env_steps", "episodes", "updates", "version", "served",
                                                     "infer_batches", "infer_batch") if k in status},
                 "gpu": gpu_sample()}
            samples.append(s)
            if t_first is None and status.get("env_steps", 0) > 0:
                t_first = now
            if len(samples) % 6 == 0:  # a partial report, should the run be cut off
                partial = summarize(samples, read_metrics(run_dir / "metrics.jsonl"),
                                    status.get("actors_table", []), t_first, now)
                (out / "e2e.json").write_text(json.dumps({**partial, "final": False}, indent=1))
            print(f"[{now:5.0f}s] steps {s.get('env_steps')} episodes {s.get('episodes')} updates "
                  f"{s.get('updates')} v{s.get('version')} served {s.get('served')} batch "
                  f"{s.get('infer_batch', 0):.1f} gpu {s['gpu']}", flush=True)
            dead = [p.name for p in procs[1:] if p.poll() not in (None, 0)]  # type: ignore[attr-defined]
            if dead:
                print(f"actors exited: {dead}", flush=True)
                if len(dead) == len(procs) - 1:
                    raise RuntimeError(f"every actor exited; see {out}/actor*.log")
            if t_first is None and now > args.startup_timeout_s:
                raise RuntimeError(f"no env step within {args.startup_timeout_s:.0f} s; see {out}/*.log")
            if t_first is not None and now - t_first >= args.minutes * 60:
                break
    finally:
        stop_processes(procs, 60)
    res = summarize(samples, read_metrics(run_dir / "metrics.jsonl"), status.get("actors_table", []),
                    t_first, time.monotonic() - t0)
    res["startup_s"] = round(t_first, 1) if t_first is not None else None
    res["actors_started"] = args.actors
    res["overrides"] = {"common": args.common, "learner": args.learner, "actor": args.actor}
    res["final"] = True
    (out / "e2e.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("actors",)}, indent=1))
    return res


if __name__ == "__main__":
    main()
