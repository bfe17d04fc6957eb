"""Action discontinuity at chunk boundaries with and without real-time chunking, under injected
network delay (docs/rtc.md).

For each delay of ``--delays`` (ms, :class:`tools.bench.netproxy.NetProxy` between actor and learner,
added to every chunk each way) and each of RTC off / on, a real learner (``learner.app``, in this
process, ``transport.act_socket=false`` so that every act crosses the proxy) serves a PI0 to a
real actor (``actor.app``) paced at ``--control-hz``, both on the fast path without graphs
(``policy.fast_serving=eager``, deterministic acts). The records the learner ingests give each
episode's executed actions and chunk boundaries (``chunk_start``: with RTC the step where the
new chunk takes over). Per run:

- ``boundary_mean_da`` / ``within_mean_da`` (and ``_max_``): ``|a_t - a_{t-1}|`` (L2 over the
  action dims) on steps that start a chunk vs the other steps;
- ``boundary_max_jerk`` / ``within_max_jerk``: the largest third difference
  ``|a_t - 3a_{t-1} + 3a_{t-2} - a_{t-3}|`` over windows that span a boundary vs the others;
- ``steps_per_s``: the control rate reached inside episodes (from each episode's first env step
  to its last; without RTC the loop waits for every chunk),
  ``act_ms`` (mean act latency seen by the actor's chunker, RTC runs), ``stalls`` (RTC: the chunk
  ran out before the reply), ``delays`` (RTC: delay sent -> steps the reply took, counts) and
  ``success`` (the env's flag, per episode).

    python -m tools.bench.rtc_measure --json docs/rtc.json              # tiny PI0 (random), point_reach
    python -m tools.bench.rtc_measure --checkpoint /work/ckpt/pi0_small_sft --env libero_spatial \\
        --policy pi0_small --extra env.image_size=64 --init-states 0,1,2,3,4 --json docs/rtc_libero.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def compose(name: str, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return hydra_compose(config_name=name, overrides=overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discontinuity(episodes: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """``episodes``: (executed actions [T, A], chunk_start [T]) each -> the figures above."""
    bda, wda, bj, wj = [], [], [], []
    for a, s in episodes:
        if len(a) < 2:
            continue
        d = np.linalg.norm(np.diff(a, axis=0), axis=1)  # d[t - 1] = |a_t - a_{t-1}|
        b = s[1:].astype(bool)
        bda += d[b].tolist()
        wda += d[~b].tolist()
        if len(a) >= 4:
            j = np.linalg.norm(a[3:] - 3 * a[2:-1] + 3 * a[1:-2] - a[:-3], axis=1)
            span = (s[1:-2] | s[2:-1] | s[3:]).astype(bool)  # a jump at t = k+1..k+3 in window k
            bj += j[span].tolist()
            wj += j[~span].tolist()

    def stat(x, f):
        return float(f(x)) if x else None

    return {"boundaries": len(bda), "boundary_mean_da": stat(bda, np.mean), "within_mean_da": stat(wda, np.mean),
            "boundary_max_da": stat(bda, np.max), "within_max_da": stat(wda, np.max),
            "boundary_max_jerk": stat(bj, np.max), "within_max_jerk": stat(wj, np.max)}


def episodes_of(stored: list[dict]) -> tuple[list, list]:
    recs = {k: np.concatenate([b[k] for b in stored]) for k in stored[0]}
    eps, success = [], []
    for e in np.unique(recs["episode"]):
        m = recs["episode"] == e
        last = m & recs["is_last"]
        steps = np.flatnonzero(m & ~recs["is_last"])
        steps = steps[np.argsort(recs["step"][steps])]
        eps.append((recs["action"][steps], recs["chunk_start"][steps]))
        success.append(bool(recs["success"][last].any()) if last.any() else None)
    return eps, success


def run_one(args, delay_ms: float, rtc: bool, policy: list[str], tmp: Path) -> dict:
    from actor.app import Actor
    from learner.app import Learner
    from tools.bench.netproxy import NetProxy

    port, pub = free_port(), free_port()
    run_dir = tmp / f"d{int(delay_ms)}_{'rtc' if rtc else 'sync'}"
    common = [f"env={args.env}", f"run_dir={run_dir}", f"transport.pub_port={pub}", *policy, *args.extra]
    jobs = [f"{{job_id:{i},task_id:{args.task_id},init_state:{s},seed:{i},group_id:-1,deterministic:true}}"
            for i, s in enumerate(args.init_states)]
    learner = Learner(compose("learner", common + [
        f"transport.port={port}", "transport.act_socket=false", "algo=rejection_sampling", "algo.eval_episodes=0",
        "algo.env_steps_per_cycle=100000000", "device=cpu", "logging.wandb=disabled", "buffer.persist=false",
        f"trainer.num_threads={args.threads}", f"rtc.enabled={str(rtc).lower()}",
        f"rtc.execution_horizon={args.execution_horizon}", f"rtc.max_guidance_weight={args.max_guidance_weight}",
        f"rtc.prefix_attention_schedule={args.schedule}", *([f"jobs=[{','.join(jobs)}]"] if jobs else [])]))
    stored: list[dict] = []
    on_records = learner.ingest.on_records

    def observed(batch, keep):
        stored.append({k: np.array(v)[np.asarray(keep)] for k, v in batch.arrays.items()})
        return on_records(batch, keep)

    learner.ingest.on_records = observed
    lt = threading.Thread(target=learner.run, daemon=True)
    lt.start()
    proxy = NetProxy(0, port, delay_ms=delay_ms)
    episodes = len(args.init_states) or args.episodes
    try:
        actor = Actor(compose("actor", common + [
            f"transport.port={proxy.port}", "actor_id=m0", "spool.fsync=false", f"max_episodes={episodes}",
            f"chunk.rtc={str(rtc).lower()}", f"chunk.execute={args.execute}", f"chunk.control_hz={args.control_hz}",
            "deterministic=true", "transport.timeout_s=10", "live=false", "drain_s=60"]))
        stamps: list[float] = []
        step = actor.env.step

        def timed_step(action):  # the env's own step, timed
            stamps.append(time.monotonic())
            return step(action)

        actor.env.step = timed_step
        t0 = time.monotonic()
        loop = actor.run()
        wall = time.monotonic() - t0
        time.sleep(0.5)
    finally:
        learner.stop()
        lt.join(60)
        proxy.close()
    eps, success = episodes_of(stored)
    if args.dims:  # e.g. LIBERO's arm without the gripper (its -1 <-> 1 toggles dominate the maxima)
        lo, hi = (int(x) for x in args.dims.split(":"))
        measured = [(a[:, lo:hi], s) for a, s in eps]
    else:
        measured = eps
    # inside episodes: from each episode's first env step to its last (a reset and the episode's
    # first, waited-for chunk are outside; a wait for a later chunk is inside)
    lens, inside, i = [len(a) for a, _ in eps], 0.0, 0
    for n in lens:
        inside += stamps[i + n - 1] - stamps[i] if n > 1 else 0.0
        i += n
    out = {"delay_ms": delay_ms, "rtc": rtc, "episodes": len(eps), "steps": loop.steps, "wall_s": wall,
           "steps_per_s": (sum(lens) - len(lens)) / inside if inside else None,
           "success": [s for s in success if s is not None], **discontinuity(measured)}
    ch = actor.rtc
    if ch is not None:
        out.update(requests=ch.requests, joins=ch.joins, stalls=ch.stalls, stall_s=ch.stall_s,
                   act_ms=1000 * float(np.mean(ch.latency)) if ch.latency else None,
                   delays={f"{s}->{k}": n for (s, k), n in sorted(Counter(ch.delays).items())})
    return out


def tiny_checkpoint(args, tmp: Path) -> list[str]:
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0

    spec = env_spec(compose("learner", [f"env={args.env}", *args.extra]).env)
    ck = make_pi0(tmp / "pi0", spec, chunk_size=args.chunk, image_size=32)
    return ["policy=pi0", f"policy.checkpoint={ck}", f"policy.chunk_size={args.chunk}", "policy.lora_rank=0"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,50,150", help="ms added by the proxy to every chunk, each way")
    ap.add_argument("--env", default="point_reach")
    ap.add_argument("--checkpoint", default=None, help="a trained PI0 checkpoint (default: a tiny random one)")
    ap.add_argument("--policy", default="pi0", help="policy config with --checkpoint (pi0, pi05, pi0_small)")
    ap.add_argument("--chunk", type=int, default=20, help="chunk of the tiny PI0 (a checkpoint has its own)")
    ap.add_argument("--execute", type=int, default=10, help="chunk.execute: steps per chunk before the switch")
    ap.add_argument("--control-hz", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=5, help="policy.num_inference_steps")
    ap.add_argument("--episodes", type=int, default=4, help="without --init-states")
    ap.add_argument("--init-states", default="", help="LIBERO: init states run as jobs, one episode each")
    ap.add_argument("--task-id", type=int, default=0)
    ap.add_argument("--execution-horizon", type=int, default=10)
    ap.add_argument("--max-guidance-weight", type=float, default=10.0)
    ap.add_argument("--schedule", default="LINEAR")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for both (env.max_episode_steps=60 ...)")
    ap.add_argument("--dims", default="", help="action dims the figures read, lo:hi (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.init_states = [int(s) for s in args.init_states.split(",") if s.strip()]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
           "load_before": os.getloadavg(), "args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        policy = ([f"policy={args.policy}", f"policy.checkpoint={args.checkpoint}"] if args.checkpoint
                  else tiny_checkpoint(args, tmp))
        policy += ["policy.device=cpu", "policy.fast_serving=eager", f"policy.num_inference_steps={args.steps}",
                   "policy.fast_warmup_buckets=[]"]
        for d in [float(x) for x in args.delays.split(",")]:
            for rtc in (False, True):
                r = run_one(args, d, rtc, policy, tmp)
                res["runs"].append(r)
                print(format_run(r), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(res, indent=1))
    res["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


def format_run(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    line = (f"delay {r['delay_ms']:>5.0f} ms  rtc {'on ' if r['rtc'] else 'off'}  |da| boundary {f(r['boundary_mean_da'])} "
            f"(max {f(r['boundary_max_da'])}) within {f(r['within_mean_da'])} (max {f(r['within_max_da'])})  "
            f"max jerk boundary {f(r['boundary_max_jerk'])} within {f(r['within_max_jerk'])}  "
            f"{r['steps_per_s']:.1f} steps/s  success {sum(r['success'])}/{len(r['success'])}")
    if r["rtc"]:
        line += f"  act {f(r['act_ms'])} ms stalls {r['stalls']} delays {r['delays']}"
    return line


if __name__ == "__main__":
    main()
