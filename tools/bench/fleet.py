"""How many robots one learner serves: N simulated actors against one real learner process.

    python -m tools.bench.fleet --loads state,camera --actors 16,64,256 --seconds 40 \\
        --json docs/fleet.json --png docs/fleet.png

Per load and N (``--learner-per load``: per load), a fresh ``python -m learner`` on loopback
(as a user runs it: buffer persistence on, the LeRobot episode store writing video, the wire
gate) and N simulated robots in ``--processes`` processes (:mod:`tools.bench.fleet_actors`:
the product's ActorLoop, LearnerClient and Spool on a thread each, in front of a stand-in
stepping at ``--hz``; niced by ``--robots-nice``, as they stand in for machines of their own).
All start together, run ``--seconds`` (the first ``--warmup-s`` are not counted), finish their
episodes and wait for the acks. Loads:

- ``state``: an 8-D state, the MLP policy (``algo=sac``), one act and one transition per step
  at 10 Hz;
- ``camera``: 2 cameras at 224x224 and the state, ``algo=rejection_sampling``, chunks of
  ``--chunk`` actions (one act every chunk: 0.5 s at 10 Hz with 5), one transition with both
  images per step; ``--policy tiny-pi0`` (default): a tiny PI0
  (:func:`tools.make_tiny_checkpoints.make_pi0`) that resizes the frames to 56x56 inside;
  ``--policy pi0``: the full-size PI0 (~3B parameters, random weights, built in the learner
  from no checkpoint as :func:`tools.bench.policy.build` builds it, nothing downloaded or
  written), served by the fast path's CUDA graphs without ``torch.compile``, every batch
  bucket up to ``inference.max_batch`` (``--serve-buckets``) captured before the service starts
  (:mod:`tools.bench.fleet_gpu`; ``--pi0-arch tiny``: the same path at test sizes, on a CPU).

``--device cuda`` puts the learner and its policy on the GPU (default ``cpu``); the JSON's
``hardware`` then names the GPU (``torch.cuda.get_device_name``) and each point has ``gpu``:
its utilization (mean, max) and peak memory over the window, from ``nvidia-smi`` once a
second. ``--learner-per load`` starts one learner per load and runs every N against it, in
the order given, new robot names each time, after waiting up to ``--settle-s`` for the last
N's episodes to become durable (a full PI0's build and captures once, not per N);
``--deadline-s`` skips the points that would end past it and ``--keep-going`` records a
failed load and goes on (a single timed GPU call still writes its JSON). The GPU figures
(one H200, its 16 cores for the robots and the learner; about 400 s, at most ~520)::

    python -m tools.bench.fleet --device cuda --policy pi0 --loads camera,state --learner-per load \\
        --processes 12 --seconds 30 --drain-s 15 --settle-s 15 --stop-wait-s 20 --deadline-s 480 \\
        --keep-going --spool-dir /tmp/fleet-spools --json fleet_gpu.json --png fleet_gpu.png

Training is held off (``algo.learning_starts`` / ``algo.env_steps_per_cycle`` past the run) so
that the figures are the serving and ingest path's; ``--train`` lets the algorithm train as it
would. Figures per N (:mod:`tools.bench.fleet_report`): act latency p50/p99 over all acts and
per actor, the rate each actor kept, served batch sizes, ingest records/s and MB/s, acks, CPU
of every learner thread and child process (wire gate, encoders), of the simulated robots and
of the machine, peak RSS, and what saturates first. ``--learner-root DIR`` runs the learner
from another source tree (the robots stay this tree's); ``--compare-root DIR`` runs every
point twice, interleaved, the learner from DIR first, and adds the JSON's ``before`` (its
points and a per-point comparison)::

    git archive BASE | tar -x -C /tmp/base
    python -m tools.bench.fleet --compare-root /tmp/base --json docs/fleet.json --png docs/fleet.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import ROOT, emit_json, quiet_logging
from tools.bench.fleet_gpu import SERVE_BUCKETS, full_pi0_overrides, full_pi0_tokenizer, gpu_window, hardware, is_cuda
from tools.bench.fleet_report import compare, plot, summarize, verdict
from tools.bench.fleet_sample import Sampler, read_status, window
from tools.experiments.learning_run import stop_processes

STATE_DIM, ACTION_DIM = 8, 7
CAMERAS = {"front": [224, 224, 3], "wrist": [224, 224, 3]}


def spec_block(load: str, episode_steps: int) -> dict:
    cams = CAMERAS if load == "camera" else {}
    return {"state_dim": STATE_DIM, "action_dim": ACTION_DIM, "cameras": cams,
            "has_task": load == "camera", "max_episode_steps": episode_steps}


def _hydra_dict(d) -> str:
    """A Hydra override value for a nested dict / list / scalar."""
    if isinstance(d, dict):
        return "{" + ",".join(f"{k}:{_hydra_dict(v)}" for k, v in d.items()) + "}"
    if isinstance(d, list):
        return "[" + ",".join(_hydra_dict(v) for v in d) + "]"
    return str(d).lower() if isinstance(d, bool) else str(d)


def learner_overrides(load: str, args, run_dir: Path, ckpt: Path | None) -> list[str]:
    o = ["env=robot", f"env.spec={_hydra_dict(spec_block(load, args.episode_steps))}", f"run_dir={run_dir}",
         f"device={args.device}", "logging.wandb=disabled", f"logging.every_s={args.status_every_s}", "logging.live=false",
         "transport.port=0", "transport.pub_port=0", "resume=never",
         # one torch thread: each learner thread's CPU is its own (a second OpenMP thread on 2
         # cores shared with the robots only spins)
         "trainer.num_threads=1"]
    if load == "state":
        o += ["algo=sac", "policy=mlp"]
        if not args.train:
            o.append("algo.learning_starts=1000000000")
    else:
        o += ["algo=rejection_sampling", "policy=pi0"]
        if args.policy == "pi0":  # full size from scratch (ckpt: its tokenizer), the policy's own LoRA rank
            o += full_pi0_overrides(ckpt, args.serve_buckets) + [f"policy.chunk_size={args.chunk}",
                                                                 f"policy.device={args.device}"]
            if args.pi0_arch == "tiny":  # the test-size architecture: a CPU dry run of this path
                from tools.make_tiny_checkpoints import TINY_PI0_ARCH
                o.append(f"+policy.arch={_hydra_dict(TINY_PI0_ARCH)}")
        else:
            o += [f"policy.checkpoint={ckpt}", f"policy.chunk_size={args.chunk}", f"policy.device={args.device}",
                  "policy.lora_rank=4"]
        o += ["algo.eval_episodes=0", "algo.pretrain_steps=0", f"buffer.capacity={args.camera_capacity}",
              # what the config's note asks for: above actors x one episode's records
              f"buffer.max_staged_mb={max(1024, 2 * args.max_actors * args.episode_steps * 0.31):.0f}"]
        if not args.train:
            o.append("algo.env_steps_per_cycle=1000000000")
    return o + list(args.learner_override)


def config_hash_of(overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir

    from data.core.spec import config_hash
    from envs.registry import env_spec

    keep = [o for o in overrides if o.split("=")[0] in ("env", "env.spec", "policy", "policy.chunk_size")]
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="learner", overrides=keep)
    return config_hash(env_spec(cfg.env), env_name=cfg.env.name, policy_name=cfg.policy.name,
                       chunk=int(cfg.policy.chunk_size))


def tiny_pi0(work: Path, chunk: int, episode_steps: int) -> Path:
    from data.core.spec import EnvSpec
    from tools.make_tiny_checkpoints import make_pi0

    ck = work / f"pi0_tiny_c{chunk}"
    if not (ck / "config.json").exists():
        spec = EnvSpec.from_dict({**spec_block("camera", episode_steps), "extras": {}})
        # the cameras send 224x224; the tiny model resizes them to 56x56 inside (its vision
        # tower at 224 costs ~75 ms per observation on this CPU: inference alone would cap N)
        make_pi0(ck, spec, chunk_size=chunk, image_size=56, seed=0)
    return ck


# ---- one point -----------------------------------------------------------------------------------

def start_learner(overrides: list[str], run_dir: Path, root: Path, timeout_s: float) -> tuple[subprocess.Popen, dict]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = open(run_dir.parent / f"{run_dir.name}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "learner", *overrides], cwd=root, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = read_status(run_dir)
        if st.get("port"):
            return p, st
        if p.poll() is not None:
            break
        time.sleep(0.5)
    stop_processes([p], 10)
    tail = (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the learner did not start (exit {p.returncode}):\n{tail}")


def start_shared(load: str, args, work: Path, ckpt: Path | None) -> dict:
    """``--learner-per load``: one learner for every N of ``load`` (the full PI0's build and
    graph captures once, not once per N)."""
    run_dir = work / (f"{load}_all" + (f"_{args.tag}" if args.tag else ""))
    overrides = learner_overrides(load, args, run_dir, ckpt)
    chash = config_hash_of(overrides)
    t0 = time.monotonic()
    proc, st0 = start_learner(overrides, run_dir, Path(args.learner_root or ROOT), args.start_timeout_s)
    return {"proc": proc, "st0": st0, "run_dir": run_dir, "chash": chash, "start_s": round(time.monotonic() - t0, 1)}


def settle(run_dir: Path, limit_s: float) -> tuple[float, bool]:
    """On a shared learner, before the next N: wait (at most ``limit_s``) until no episode waits
    for the dataset and every record is acknowledged, so that the last N's backlog is not
    counted against the next. (seconds waited, settled)"""
    t0 = time.monotonic()
    while True:
        st = read_status(run_dir)
        done = bool(st) and not st.get("dataset_pending") and not st.get("store_lag_records")
        if done or time.monotonic() - t0 >= limit_s:
            return round(time.monotonic() - t0, 1), done
        time.sleep(0.5)


def run_point(load: str, n: int, args, work: Path, ckpt: Path | None, shared: dict | None = None) -> dict:
    """One (load, N): a fresh learner (``shared`` None, stopped at the end) or ``shared``'s."""
    tag = f"{load}_n{n}" + (f"_{args.tag}" if args.tag else "")
    extra: dict = {}
    if shared is None:
        run_dir = work / tag
        overrides = learner_overrides(load, args, run_dir, ckpt)
        chash = config_hash_of(overrides)
    else:
        run_dir, chash = shared["run_dir"], shared["chash"]
        if shared["proc"].poll() is not None:
            raise RuntimeError(f"the shared learner exited ({shared['proc'].returncode}), see {run_dir}.log")
        extra["settle_s"], extra["settled"] = settle(run_dir, args.settle_s)
    load_before = os.getloadavg()
    if shared is None:
        t_start = time.monotonic()
        learner, st0 = start_learner(overrides, run_dir, Path(args.learner_root or ROOT), args.start_timeout_s)
        extra["learner_start_s"] = round(time.monotonic() - t_start, 1)
    else:
        learner, st0 = shared["proc"], shared["st0"]
        extra.update(learner_start_s=shared["start_s"], learner_shared=True)
    spool_root = Path(args.spool_dir) / tag
    shutil.rmtree(spool_root, ignore_errors=True)
    procs = max(1, min(args.processes, n))
    hz = args.hz
    base = {"port": st0["port"], "config_hash": chash, "spool_root": str(spool_root), "hz": hz,
            "spec": spec_block(load, args.episode_steps), "episode_steps": args.episode_steps,
            "batch_records": args.batch_records, "seconds": args.seconds, "warmup_s": args.warmup_s,
            "drain_s": args.drain_s, "timeout_s": 2.0, "heartbeat_s": 1.0, "connect_s": 120.0,
            "phase_s": (args.chunk if load == "camera" else 1) / hz, "spool_cache_mb": args.spool_cache_mb,
            "seed": 0, "nice": args.robots_nice}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1"}
    workers: list[subprocess.Popen] = []
    try:
        for i in range(procs):
            # a shared learner has seen the last N's robots: new names, their own sequence numbers
            ids = [(f"n{n}-" if shared else "") + f"robot{j:04d}" for j in range(i, n, procs)]
            w = subprocess.Popen([sys.executable, "-m", "tools.bench.fleet_actors"], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 stderr=open(work / f"{tag}_robots{i}.log", "w"))
            w.stdin.write(json.dumps({**base, "actors": ids, "first_index": i}) + "\n")
            w.stdin.flush()
            workers.append(w)
        errors = []
        for w in workers:
            ready = json.loads(w.stdout.readline() or '{"ready": 0, "errors": ["no answer"]}')
            errors += ready["errors"]
        if errors:
            raise RuntimeError(f"robots failed to connect: {errors[:3]}")
        sampler = Sampler(learner.pid, [w.pid for w in workers], run_dir,
                          gpu=args.device if is_cuda(args.device) else None)
        lead = 2.0
        for w in workers:
            w.stdin.write(f"go {lead}\n")
            w.stdin.flush()
        t0 = time.monotonic() + lead
        time.sleep(max(0.0, t0 + args.warmup_s - time.monotonic()))
        a = sampler.snapshot()
        time.sleep(max(0.0, t0 + args.seconds - time.monotonic()))
        b = sampler.snapshot()
        outs, lost = [], []
        for i, w in enumerate(workers):
            out, _ = w.communicate(timeout=args.drain_s + 180)
            lines = out.strip().splitlines()
            if lines and lines[-1].startswith("{"):
                outs.append(json.loads(lines[-1]))
            else:  # counted, not fatal: the point keeps the other processes' robots
                lost.append(f"robot process {i} ended without figures (exit {w.returncode}, "
                            f"see {work / f'{tag}_robots{i}.log'})")
        if not outs:
            raise RuntimeError("; ".join(lost))
        sampler.close()
        final = read_status(run_dir)
        names = {**a["status"].get("threads", {}), **b["status"].get("threads", {}), **final.get("threads", {})}
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        if shared is None:
            stop_processes([learner], args.stop_wait_s)
        shutil.rmtree(spool_root, ignore_errors=True)
    point = summarize(load=load, n=n, hz=hz, chunk=args.chunk if load == "camera" else 1,
                      batch_records=args.batch_records,
                      robots=[r for o in outs for r in o["actors"]], window_s=outs[0]["window_s"],
                      cpu=window(a, b, names), status=(a["status"], b["status"], final), peak_rss=sampler.peak)
    point["errors"] = lost + point["errors"]
    if sampler.gpu:
        point["gpu"] = gpu_window(sampler.gpu_samples, a["t"], b["t"])
    point.update(processes=procs, load_avg_before=[round(x, 2) for x in load_before],
                 load_avg_after=[round(x, 2) for x in os.getloadavg()], learner_exit=learner.returncode,
                 tag=args.tag or None, **extra)
    return point


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="state,camera", help="comma-separated: state, camera")
    ap.add_argument("--actors", default="16,64,256", help="comma-separated N")
    ap.add_argument("--seconds", type=float, default=40.0, help="per N, warm-up included")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="first seconds not counted")
    ap.add_argument("--drain-s", type=float, default=30.0, help="at the end, wait this long for the acks")
    ap.add_argument("--hz", type=float, default=10.0, help="each robot's control rate")
    ap.add_argument("--chunk", type=int, default=5, help="camera load: actions per served chunk")
    ap.add_argument("--episode-steps", type=int, default=50, help="steps per episode (truncated)")
    ap.add_argument("--batch-records", type=int, default=1, help="records per transitions message")
    ap.add_argument("--processes", type=int, default=8, help="robot processes (threads share them)")
    ap.add_argument("--robots-nice", type=int, default=10, help="the robot processes' niceness: on the "
                    "learner's cores they stand in for machines of their own and yield to it (0: equal)")
    ap.add_argument("--camera-capacity", type=int, default=2000, help="camera load: replay capacity")
    ap.add_argument("--spool-cache-mb", type=int, default=4, help="each robot's in-memory spool copies")
    ap.add_argument("--status-every-s", type=float, default=1.0, help="the learner's logging.every_s")
    ap.add_argument("--train", action="store_true", help="let the algorithm train during the run")
    ap.add_argument("--learner-root", default=None, help="run the learner from this source tree")
    ap.add_argument("--compare-root", default=None, help="also run each point with the learner from this "
                    "tree, just before (interleaved): the JSON's 'before' and its comparison")
    ap.add_argument("--learner-override", action="append", default=[], help="extra learner override")
    ap.add_argument("--work", default=None, help="run dirs (default: a temporary folder)")
    ap.add_argument("--spool-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--stop-wait-s", type=float, default=60.0, help="SIGINT, then kill the learner after this")
    ap.add_argument("--device", default="cpu", help="the learner's device and its policy's: cpu | cuda | cuda:N")
    ap.add_argument("--policy", default="tiny-pi0", choices=("tiny-pi0", "pi0"), help="camera load: tiny-pi0 (a "
                    "test-size checkpoint, frames resized to 56 inside) | pi0 (full size, random weights, built "
                    "in the learner; tools/bench/fleet_gpu.py)")
    ap.add_argument("--pi0-arch", default="full", choices=("full", "tiny"), help="--policy pi0's sizes (tiny: "
                    "the test-size architecture, a CPU dry run of the full-size path)")
    ap.add_argument("--serve-buckets", default=list(SERVE_BUCKETS), type=_ints,
                    help="--policy pi0: batch sizes whose CUDA graphs the learner captures before serving")
    ap.add_argument("--learner-per", default="point", choices=("point", "load"), help="a fresh learner per N "
                    "(point) or one per load, every N in the order given against it (load)")
    ap.add_argument("--settle-s", type=float, default=30.0, help="--learner-per load: before each N, wait at "
                    "most this long for the last N's episodes to become durable")
    ap.add_argument("--keep-going", action="store_true", help="a load whose learner or point fails is "
                    "recorded in the JSON's 'failed' and the next load goes on")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="skip the points that would start later "
                    "than this many seconds minus --seconds and --drain-s after the start (0: none)")
    ap.add_argument("--tag", default="", help="label of this run (kept in the JSON)")
    ap.add_argument("--json", default="-", help="output JSON path ('-': one line on stdout)")
    ap.add_argument("--png", default=None, help="plot of N against latency and throughput")
    return ap


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.learner_per == "load" and args.compare_root:
        ap.error("--compare-root runs a fresh learner per point: use --learner-per point")
    t_begin = time.monotonic()
    quiet_logging()
    loads = [x for x in args.loads.split(",") if x]
    ns = [int(x) for x in args.actors.split(",") if x]
    args.max_actors = max(ns)
    hw = hardware(args.device)  # first: --device cuda without a GPU stops here
    work = Path(args.work or tempfile.mkdtemp(prefix="tandem-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if "camera" in loads:
        ckpt = full_pi0_tokenizer(work) if args.policy == "pi0" else tiny_pi0(work, args.chunk, args.episode_steps)
    # --compare-root: each point twice, interleaved, the learner from that tree first ("before")
    roots = ([("before", args.compare_root), ("after", args.learner_root)] if args.compare_root
             else [(args.tag, args.learner_root)])
    points, base, skipped, failed = [], [], [], []
    for load in loads:
        shared, mine = None, []
        try:
            for n in ns:
                for tag, root in roots:
                    args.tag, args.learner_root = tag, root
                    left = args.deadline_s - (time.monotonic() - t_begin)
                    if args.deadline_s and left < args.seconds + args.drain_s:
                        skipped.append({"load": load, "actors": n, "tag": tag or None, "seconds_left": round(left)})
                        say(f"[fleet] {load} N={n} skipped: {left:.0f} s left")
                        continue
                    if args.learner_per == "load" and shared is None:
                        shared = start_shared(load, args, work, ckpt)
                        say(f"[fleet] {load}: one learner for every N, started in {shared['start_s']} s")
                    say(f"[fleet] {load} N={n} {tag}: load avg {os.getloadavg()[0]:.2f}")
                    p = run_point(load, n, args, work, ckpt, shared)
                    say(f"[fleet]   act p50 {p['act_ms']['p50']:.1f} ms p99 {p['act_ms']['p99']:.1f} ms, "
                        f"rate kept by {p['rate']['kept_fraction']:.0%}, batch {p['infer_batch']:.1f}, "
                        f"ingest {p['ingest']['records_per_s']:.0f} rec/s"
                        + (f", GPU {p['gpu']['util_pct_mean']:.0f}% busy" if p.get("gpu") else ""))
                    (base if tag == "before" and args.compare_root else points).append(p)
                    mine.append(p)
                    if args.json != "-":  # what is done so far survives a later failure
                        Path(args.json + ".partial").write_text(json.dumps({"points": points, "before": base}))
        except Exception as exc:
            if not args.keep_going:
                raise
            failed.append({"load": load, "error": f"{type(exc).__name__}: {exc}"[-3000:]})
            say(f"[fleet] {load} FAILED: {failed[-1]['error']}")
        finally:
            if shared is not None:
                stop_processes([shared["proc"]], args.stop_wait_s)
                for p in mine:
                    p["learner_exit"] = shared["proc"].returncode
    out = {"command": "python -m tools.bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "hardware": hw,
           "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
           "points": points, "saturation": verdict(points)}
    out.update({k: v for k, v in (("skipped", skipped), ("failed", failed)) if v})
    if base:
        out["before"] = {"learner_root": args.compare_root, "points": base, "saturation": verdict(base),
                         "comparison": compare(base, points)}
    emit_json(out, args.json)
    if args.png and points:
        plot(out, args.png)
    return out


if __name__ == "__main__":
    main()
