"""Learning runs through the real system, for the tool runs that show an algorithm learning
(tools/experiments/flow_ppo_demo.py, tools/experiments/oft_grpo_demo.py, the rejection-sampling tools): a learner and
actor processes on loopback, and success by policy version read back from the run's LeRobot
dataset or its status."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def version_success(dataset: Path) -> dict[int, list[bool]]:
    """Outcomes of the stored episodes by the newest policy version that acted in them (read
    from the dataset's parquet columns alone: no camera frames decoded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ["episode_index", "frame_index", "is_last", "policy_version", "next.success"]
    files = sorted((dataset / "data").glob("**/*.parquet"))
    if not files:
        return {}
    t = pa.concat_tables([pq.read_table(f, columns=cols) for f in files])
    d = {c: np.asarray(t.column(c).to_numpy(zero_copy_only=False)).reshape(len(t), -1)[:, 0] for c in cols}
    out: dict[int, list[bool]] = {}
    order = np.lexsort((d["frame_index"], d["episode_index"]))
    d = {k: v[order] for k, v in d.items()}
    starts = np.flatnonzero(np.r_[True, d["episode_index"][1:] != d["episode_index"][:-1]])
    for s, e in zip(starts, np.r_[starts[1:], len(order)]):
        steps = ~d["is_last"][s:e].astype(bool)
        v = int(d["policy_version"][s:e][steps if steps.any() else slice(None)].max())
        out.setdefault(v, []).append(bool(d["next.success"][e - 1]))
    return out


def stop_processes(procs: Sequence[subprocess.Popen], wait_s: float) -> None:
    """SIGINT every process still running (a learner checkpoints, actors flush), then wait up to
    ``wait_s`` for each and kill what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def read_status(run_dir: Path) -> dict:
    """The learner's ``status.json`` ({} while it is missing or half-written)."""
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}

#: the environment of every learner and actor a tool starts (unbuffered logs, no wandb, one
#: OpenMP thread each: several processes share the machine's cores)
CHILD_ENV = {"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def start_processes(log_dir: Path, common: Sequence[str],
                    specs: Sequence[tuple[str, str, Sequence[str]]]) -> list[subprocess.Popen]:
    """``python -m MODULE *common *args`` for each ``(name, module, args)`` of ``specs``, its
    output in ``log_dir/<name>.log`` (``p.name``, ``p.log``). SIGINT is back at its default in
    the children: a shell's background job ignores it, and so would they (then the learner never
    checkpoints at the stop)."""
    env = {**os.environ, **CHILD_ENV}
    procs = []
    for name, module, args in specs:
        log = Path(log_dir) / f"{name}.log"
        with open(log, "ab") as f:
            p = subprocess.Popen([sys.executable, "-m", module, *common, *args], cwd=ROOT, env=env, stdout=f,
                                 stderr=subprocess.STDOUT,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        p.name, p.log = name, log
        procs.append(p)
    return procs


def watch(procs: Sequence[subprocess.Popen], run_dir: Path, *, max_s: float, poll_s: float,
          done: Callable[[dict, float], bool]) -> dict:
    """Every ``poll_s`` until ``max_s``: fail (RuntimeError with its log's tail) when a process
    has exited, read the learner's status (the last one read stays while it is missing) and stop
    when ``done(status, seconds since the start)``. Returns the last status."""
    t0, status = time.monotonic(), {}
    while time.monotonic() - t0 < max_s:
        time.sleep(poll_s)
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.log.name} exited {p.returncode}:\n{p.log.read_text()[-3000:]}")
        status = read_status(run_dir) or status
        if done(status, time.monotonic() - t0):
            break
    return status


def wait_unpaused(out: Path) -> None:
    """While ``out/pause`` exists, wait (a long series of runs can be paused between runs)."""
    while (out / "pause").exists():
        time.sleep(2.0)


def record_result(out: Path, r: dict, *, hide: Sequence[str] = ()) -> None:
    """Add the machine's ``uptime`` to ``r``, print it (without the ``hide`` keys) and append it
    to ``out/results.jsonl``."""
    r["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({k: v for k, v in r.items() if k not in hide}), flush=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")



def rs_history(status: dict) -> list[dict]:
    """Rejection sampling's evaluation history in a status (baseline first)."""
    return status.get("replay", {}).get("rs", {}).get("history", [])


def run_rs_cycles(run_dir: Path, common: Sequence[str], learner_o: Sequence[str], actor_o: Sequence[str], *,
                  cycles: int, max_s: float, label: str = "") -> dict:
    """A rejection-sampling learner and one actor (``python -m learner`` / ``actor`` with
    ``common`` plus their own overrides, logs in ``run_dir``) until ``cycles`` + 1 gate
    evaluations (the baseline first) or ``max_s``, then SIGINT. Returns the last ``status``,
    its ``history``, ``wall_s`` and the 1-min load at the start and at each evaluation."""
    loads, t0, seen = [os.getloadavg()[0]], time.monotonic(), 0
    procs = start_processes(run_dir, common, [("learner", "learner", learner_o), ("actor", "actor", actor_o)])

    def done(status: dict, t: float) -> bool:
        nonlocal seen
        hist = rs_history(status)
        if len(hist) > seen:
            seen = len(hist)
            loads.append(os.getloadavg()[0])
            h = hist[-1]
            print(f"[{label}{t:5.0f}s] v{h['version']} gate success {h['success']} "
                  f"({h['decision']}) episodes {status.get('replay', {}).get('episodes')}", flush=True)
        return seen >= cycles + 1

    status = {}
    try:
        status = watch(procs, run_dir, max_s=max_s, poll_s=1.0, done=done)
    finally:
        stop_processes(procs, 60)
    wall = time.monotonic() - t0
    status = read_status(run_dir) or status
    return {"status": status, "history": rs_history(status), "wall_s": round(wall, 1),
            "load_1min": [round(x, 2) for x in loads]}


def trained_policy(overrides: Sequence[str], seed: int, state: dict | None = None):
    """The policy a learner configured by ``overrides`` trains, built as the learner builds it
    (torch seed ``seed``), with the trainable ``state`` loaded when given; eval mode."""
    import torch

    from agents import registry
    from envs.registry import env_spec
    from tools.sft import learner_config

    cfg = learner_config(list(overrides))
    torch.manual_seed(seed)
    policy = registry.build_trained_policy(registry.build_builder(cfg.algo), cfg.policy, env_spec(cfg.env))
    if state is not None:
        policy.load_trainable_state_dict(state)
    return policy.eval()


def train_to_updates(out: Path, name: str, seed: int, common_o: Sequence[str], algo_o: Sequence[str], *,
                     updates: int, actors: int, max_s: float, extra: Sequence[str] = ()) -> dict:
    """A CPU learner (``algo_o`` + ``extra``; a checkpoint every 500 updates, all kept) and
    ``actors`` actors on ``common_o`` in the new folder ``out/<name>_seed<seed>`` until ``updates``
    updates (or ``max_s``): :func:`run_until_updates`'s result."""
    run = out / f"{name}_seed{seed}"
    run.mkdir(parents=True, exist_ok=False)
    port, pub = free_port(), free_port()
    common = [*common_o, f"run_dir={run}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=5.0", "transport.heartbeat_s=0.5"]
    learner_o = [*algo_o, "device=cpu", "logging.wandb=disabled", "logging.every_s=5", "trainer.num_threads=1",
                 "buffer.persist=false", "trainer.checkpoint_every=500", "trainer.keep_checkpoints=100",
                 f"seed={seed}", *extra]
    return run_until_updates(run, common, learner_o, actors=actors, seed=seed, updates=updates, max_s=max_s,
                             poll_s=2.0, label=name)


def run_until_updates(run_dir: Path, common: Sequence[str], learner_o: Sequence[str], *, actors: int, seed: int,
                      updates: int, max_s: float, poll_s: float, label: str) -> dict:
    """A learner and ``actors`` remote actors (seeds ``100 * seed + i``; logs in ``run_dir``) until
    the learner has made ``updates`` updates (or ``max_s``), then SIGINT. Returns the learner's
    last status, the final checkpoint's trained policy state (``policy``) and its name,
    ``wall_s``, the 1-min load and a trace [s, episodes, updates, success] every 10 s."""
    from learner.checkpoint import latest_checkpoint, load_checkpoint

    loads, trace = [], []
    t0 = time.monotonic()
    procs = start_processes(run_dir, common, [
        ("learner", "learner", learner_o),
        *((f"actor{i}", "actor", [f"actor_id=a{i}", "spool.fsync=false", "log_every_s=10", f"seed={100 * seed + i}"])
          for i in range(actors))])

    def done(status: dict, t: float) -> bool:
        if t >= 10 * len(loads):
            loads.append(round(os.getloadavg()[0], 2))
            trace.append([round(t), status.get("episodes"), status.get("updates"), status.get("success")])
            print(f"[{label} seed {seed} {t:4.0f}s] episodes {status.get('episodes')} updates "
                  f"{status.get('updates')} success(window) {status.get('success')} load {loads[-1]}", flush=True)
        return (status.get("updates") or 0) >= updates

    status = {}
    try:
        status = watch(procs, run_dir, max_s=max_s, poll_s=poll_s, done=done)
    finally:
        stop_processes(list(reversed(procs)), 120)
    wall = time.monotonic() - t0
    status = read_status(run_dir) or status
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise RuntimeError(f"{run_dir}: no checkpoint (did the learner update?)")
    return {"status": status, "policy": load_checkpoint(path)["algo"]["agent"]["policy"], "checkpoint": path.name,
            "wall_s": round(wall, 1), "load_1min": loads, "trace": trace, "run_dir": str(run_dir)}


def timed_control(train: Callable[[], tuple], score: Callable[[object], float]) -> dict:
    """The same-wall-clock control of a learning claim: ``train()`` (more BC for the RL arm's
    seconds) -> (model, steps taken); the summary's ``more_bc_after`` (``score(model)``),
    ``more_bc_steps`` and ``more_bc_load_1min`` (before training, after scoring: the steps a
    timed control takes depend on the machine's load)."""
    load0 = round(os.getloadavg()[0], 2)
    model, steps = train()
    after = score(model)
    return {"more_bc_after": after, "more_bc_steps": steps, "more_bc_load_1min": [load0, round(os.getloadavg()[0], 2)]}


def seeds_parser(doc: str, max_s: float) -> argparse.ArgumentParser:
    """The arguments every pre-registered claim's tool takes: ``--out``, ``--seeds``, ``--max-s``
    (bounds a stuck run only) and extra learner overrides after ``--``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--max-s", type=float, default=max_s, help="bounds a stuck run only")
    ap.add_argument("overrides", nargs="*", help="extra learner overrides (after --)")
    return ap


def passes_by_margin(r: dict, after: str, over: Sequence[str], margin: float) -> bool:
    """A registered per-seed rule: ``r[after]`` >= each of ``r[k]`` for ``k`` in ``over`` plus
    ``margin``, the differences rounded to 2 places (100 held-out episodes)."""
    return all(round(r[after] - r[k], 2) >= margin for k in over)


def online_claim_args(doc: str, arm: str, argv, *, updates: int, actors: int, base_steps: int,
                      base_what: str) -> argparse.Namespace:
    """:func:`seeds_parser`'s arguments plus those of a claim whose RL arm runs the learner for a
    number of updates from a weak base: ``--updates``, ``--actors``, ``--base-steps`` and
    ``--arms all|<arm>`` (``<arm>``: no more-BC control, for pilots)."""
    ap = seeds_parser(doc, 1200.0)
    ap.add_argument("--updates", type=int, default=updates, help=f"learner updates (rounds) of the {arm} run")
    ap.add_argument("--actors", type=int, default=actors)
    ap.add_argument("--base-steps", type=int, default=base_steps, help=f"{base_what} steps of the weak base")
    ap.add_argument("--arms", choices=["all", arm], default="all", help=f"{arm}: no more-BC control (pilots)")
    return ap.parse_args(argv)


def run_seeds(args: argparse.Namespace, prepare: Callable[[Path], Path],
              runs: Callable[[Path, Path, int], Sequence[Callable[[], dict]]], *,
              hide: Sequence[str] = ()) -> list[dict]:
    """SIGTERM as an interrupt, ``args.out`` made, the demos prepared in it; then for every seed
    the runs ``runs(out, demos, seed)`` gives, one after the other (waiting while ``out/pause``
    exists before each), each result recorded (:func:`record_result`). Returns the results."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demos = prepare(out)
    results = []
    for seed in args.seeds:
        for one in runs(out, demos, seed):
            wait_unpaused(out)
            r = one()
            record_result(out, r, hide=hide)
            results.append(r)
    return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def success_windows(by_v: dict[int, list[bool]], size: int) -> list[list]:
    """Episodes in policy-version order cut into consecutive windows of about ``size`` (whole
    versions): [[first version, last version, episodes, success], ...]."""
    out, cur, first = [], [], None
    for v in sorted(by_v):
        first = v if first is None else first
        cur += by_v[v]
        if len(cur) >= size:
            out.append([first, v, len(cur), round(float(np.mean(cur)), 3)])
            cur, first = [], None
    if cur:
        out.append([first, max(by_v), len(cur), round(float(np.mean(cur)), 3)])
    return out


def run(out: Path, common_o: Sequence[str], algo_o: Sequence[str], *, minutes: float, actors: int,
        target: float, window: int, seed: int, updates: int | None = None,
        windows: int = 200, device: str = "cpu") -> dict:
    """``python -m learner`` + ``actors`` actor processes on loopback with the shared overrides
    ``common_o`` (env, policy) and the learner's ``algo_o``, for ``minutes``, until ``updates``
    updates are done (when given: a machine's speed does not change what is measured) or until
    the learner's success over its last ``window`` episodes reaches ``target``; success by policy
    version from the run's dataset (version 0: the starting policy), also in consecutive
    windows of ``windows`` episodes. ``device``: the learner's (a GPU only speeds the search for
    settings; the learning proofs run on CPUs). Cameras are stored as PNG (lossless; no video encoder
    processes competing for the CPU)."""
    run_dir = out / "run"
    port, pub = free_port(), free_port()
    common = [*common_o, f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=2.0", "transport.heartbeat_s=0.5"]
    learner_o = [*algo_o, f"device={device}", "logging.wandb=disabled",
                 "logging.every_s=5", "trainer.num_threads=1", f"logging.stats_window={window}",
                 f"trainer.stop_at_success={target}", f"trainer.stop_min_episodes={window}",
                 "buffer.commit_interval_s=2", "buffer.video=false", f"seed={seed}"]
    t0 = time.monotonic()
    procs = start_processes(out, common, [
        ("learner", "learner", learner_o),
        *((f"actor{i}", "actor", [f"actor_id=a{i}", "spool.fsync=false", "log_every_s=10", f"seed={1000 * (i + 1)}"])
          for i in range(actors))])
    learner = procs[0]
    status = {}
    try:
        while learner.poll() is None and time.monotonic() - t0 < minutes * 60:
            time.sleep(5)
            status = read_status(run_dir) or status
            print(f"[{time.monotonic() - t0:5.0f}s] episodes {status.get('episodes')} updates "
                  f"{status.get('updates')} version {status.get('version')} success(last {window}) "
                  f"{status.get('success')}", flush=True)
            for p in procs[1:]:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{p.name} exited {p.returncode}; see {out / (p.name + '.log')}")
            if updates is not None and (status.get("updates") or 0) >= updates:
                break
    finally:
        stop_processes(procs, 90)
    wall = time.monotonic() - t0
    status = read_status(run_dir) or status
    by_v = version_success(run_dir / "dataset")
    versions = sorted(by_v)
    before = by_v.get(0, [])
    last = [o for v in versions[-3:] for o in by_v[v]] if versions else []
    return {"wall_s": round(wall, 1), "episodes": status.get("episodes"), "updates": status.get("updates"),
            "version": status.get("version"), "env_steps": status.get("env_steps"),
            "success_last_window": status.get("success"), "window": window,
            "before": {"success": float(np.mean(before)) if before else None, "episodes": len(before)},
            "after_last_3_versions": {"versions": versions[-3:], "success": float(np.mean(last)) if last else None,
                                      "episodes": len(last)},
            "windows": success_windows(by_v, windows),
            "by_version": {v: [round(float(np.mean(by_v[v])), 3), len(by_v[v])] for v in versions}}


def evaluate_policy(policy, env_cfg, episodes: int, *, seed: int, deterministic: bool = False) -> list[bool]:
    """In-process rollouts of ``policy`` on ``make_env(env_cfg)``, as an actor runs it (whole
    chunks executed open-loop, sampled unless ``deterministic``): episode ``i`` resets with seed
    ``seed + i`` (torch seeded with ``seed``); returns each episode's success."""
    import torch

    from actor.loop import obs_arrays
    from envs.registry import make_env

    env = make_env(env_cfg)
    torch.manual_seed(seed)
    wins = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            done, ok = False, False
            while not done:
                arrays, tasks = obs_arrays(obs)
                batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
                batch["task"] = tasks
                with torch.no_grad():
                    chunk = policy.act(batch, deterministic=deterministic).actions[0].cpu().numpy()
                for a in chunk:
                    obs, _, term, trunc, info = env.step(np.asarray(a, np.float32))
                    ok = bool(info.get("is_success", False))
                    if term or trunc:
                        done = True
                        break
            wins.append(ok)
    finally:
        env.close()
    return wins


def run_args(doc: str, *, minutes: float, demos: int, target: float, window: int) -> argparse.ArgumentParser:
    """The flags every learning-run tool shares (its own go after): ``--out``, ``--minutes``,
    ``--demos``, ``--actors``, ``--target``, ``--window``, ``--seed`` and learner overrides."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=minutes, help="wall-clock cap of the RL run")
    ap.add_argument("--total-minutes", type=float, default=None,
                    help="wall-clock cap of everything, preparation included (RL gets what is left)")
    ap.add_argument("--updates", type=int, default=None, help="stop after this many updates")
    ap.add_argument("--demos", type=int, default=demos)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--target", type=float, default=target)
    ap.add_argument("--window", type=int, default=window)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="the learner's and policy's device (cpu, cuda)")
    ap.add_argument("overrides", nargs="*", help="extra learner overrides (after --)")
    return ap


def rl_minutes(a: argparse.Namespace, started: float) -> float:
    """``--minutes``, cut to what ``--total-minutes`` leaves after the preparation."""
    if a.total_minutes is None:
        return a.minutes
    return max(0.5, min(a.minutes, a.total_minutes - (time.monotonic() - started) / 60))


def start_out(out: str) -> Path:
    """SIGTERM stops the run like Ctrl-C (its processes are stopped, the summary written);
    ``out`` must be new."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    path = Path(out)
    path.mkdir(parents=True, exist_ok=False)
    return path
