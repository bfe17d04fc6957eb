"""How many robots one learner serves: N simulated actors against one real learner process.

    python -m tools.bench.fleet --loads state,camera --actors 16,64,256 --seconds 40 \\
        --json docs/fleet.json --png docs/fleet.png

Per load and N, a fresh ``python -m learner`` on loopback (as a user runs it: buffer
persistence on, the LeRobot episode store writing video, the wire gate) and N simulated robots
in ``--processes`` processes (:mod:`tools.bench.fleet_actors`: the product's ActorLoop,
LearnerClient and Spool on a thread each, in front of a stand-in stepping at ``--hz``; niced by
``--robots-nice``, as they stand in for machines of their own). All
start together, run ``--seconds`` (the first ``--warmup-s`` are not counted), finish their
episodes and wait for the acks. Loads:

- ``state``: an 8-D state, the MLP policy (``algo=sac``), one act and one transition per step
  at 10 Hz;
- ``camera``: 2 cameras at 224x224 and the state, a tiny PI0 on the CPU
  (``algo=rejection_sampling``, :func:`tools.make_tiny_checkpoints.make_pi0`) serving chunks
  of ``--chunk`` actions: one act every chunk (0.5 s at 10 Hz with 5), one transition with
  both images per step.

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
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.bench.common import ROOT, emit_json, quiet_logging
from tools.bench.fleet_report import compare, plot, summarize, verdict
from tools.bench.procstat import cpu_delta, label_cpu, task_cpu, thread_cpu
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
         "device=cpu", "logging.wandb=disabled", f"logging.every_s={args.status_every_s}", "logging.live=false",
         "transport.port=0", "transport.pub_port=0", "resume=never",
         # one torch thread: each learner thread's CPU is its own (a second OpenMP thread on 2
         # cores shared with the robots only spins)
         "trainer.num_threads=1"]
    if load == "state":
        o += ["algo=sac", "policy=mlp"]
        if not args.train:
            o.append("algo.learning_starts=1000000000")
    else:
        o += ["algo=rejection_sampling", "policy=pi0", f"policy.checkpoint={ckpt}", f"policy.chunk_size={args.chunk}",
              "policy.device=cpu", "policy.lora_rank=4", "algo.eval_episodes=0", "algo.pretrain_steps=0",
              f"buffer.capacity={args.camera_capacity}",
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


# ---- /proc readings ------------------------------------------------------------------------------

def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / tck, sum(v) / tck


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def child_label(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "gate_main" in cmd:
        return "wire-gate"
    if "multiprocessing" in cmd or "spawn_main" in cmd:
        return "resource-tracker" if "resource_tracker" in cmd else "encoder-workers"
    return Path(cmd.split()[0]).name if cmd else "child"


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def read_status(run_dir: Path) -> dict:
    try:
        st = json.loads((run_dir / "status.json").read_text())
        st["_mtime"] = (run_dir / "status.json").stat().st_mtime
        return st
    except (OSError, ValueError):
        return {}


class Sampler:
    """CPU seconds of the learner's threads (named from its status.json), of its child
    processes by label, of the robots' processes and of the machine; peak RSS every second."""

    def __init__(self, learner_pid: int, worker_pids: list[int], run_dir: Path):
        self.pid, self.workers, self.run_dir = learner_pid, worker_pids, run_dir
        self.peak = {"learner": 0.0, "children": 0.0, "robots": 0.0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()

    def snapshot(self) -> dict:
        st = read_status(self.run_dir)
        kids: dict[str, float] = {}
        for c in children(self.pid):
            lab = child_label(c)
            for k in [c, *children(c)]:
                kids[lab] = kids.get(lab, 0.0) + sum(thread_cpu(pid=k).values())
        robots = sum(sum(thread_cpu(pid=w).values()) for w in self.workers)
        busy, total = machine_busy()
        return {"t": time.monotonic(), "tasks": task_cpu(self.pid), "children": kids,
                "robots": robots, "busy": busy, "total": total, "status": st}

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            kids = sum(rss_mb(c) for c in children(self.pid))
            cur = {"learner": rss_mb(self.pid), "children": kids,
                   "robots": sum(rss_mb(w) for w in self.workers)}
            self.peak = {k: max(v, cur[k]) for k, v in self.peak.items()}

    def close(self) -> None:
        self._stop.set()


def window(a: dict, b: dict, names: dict) -> dict:
    """CPU (cores) of the window between two snapshots; ``names``: thread id -> Python thread
    name (the learner's status.json; threads it does not name keep their kernel name)."""
    dt = b["t"] - a["t"]
    labels = {int(k): v for k, v in names.items()}
    th = cpu_delta(label_cpu(a["tasks"], labels), label_cpu(b["tasks"], labels))
    kids = cpu_delta(a["children"], b["children"])
    ncpu = os.cpu_count() or 1
    return {"seconds": dt,
            "learner_threads": {k: round(v / dt, 3) for k, v in sorted(th.items(), key=lambda kv: -kv[1])},
            "learner_children": {k: round(v / dt, 3) for k, v in kids.items()},
            "robots": round((b["robots"] - a["robots"]) / dt, 3),
            "machine_busy_cores": round((b["busy"] - a["busy"]) / max(1e-9, b["total"] - a["total"]) * ncpu, 3)}


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


def run_point(load: str, n: int, args, work: Path, ckpt: Path | None) -> dict:
    tag = f"{load}_n{n}" + (f"_{args.tag}" if args.tag else "")
    run_dir = work / tag
    overrides = learner_overrides(load, args, run_dir, ckpt)
    chash = config_hash_of(overrides)
    load_before = os.getloadavg()
    learner, st0 = start_learner(overrides, run_dir, Path(args.learner_root or ROOT), args.start_timeout_s)
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
            ids = [f"robot{j:04d}" for j in range(i, n, procs)]
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
        sampler = Sampler(learner.pid, [w.pid for w in workers], run_dir)
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
        stop_processes([learner], 60)
        shutil.rmtree(spool_root, ignore_errors=True)
    point = summarize(load=load, n=n, hz=hz, chunk=args.chunk if load == "camera" else 1,
                      batch_records=args.batch_records,
                      robots=[r for o in outs for r in o["actors"]], window_s=outs[0]["window_s"],
                      cpu=window(a, b, names), status=(a["status"], b["status"], final), peak_rss=sampler.peak)
    point["errors"] = lost + point["errors"]
    point.update(processes=procs, load_avg_before=[round(x, 2) for x in load_before],
                 load_avg_after=[round(x, 2) for x in os.getloadavg()], learner_exit=learner.returncode,
                 tag=args.tag or None)
    return point


def main(argv=None) -> dict:
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
    ap.add_argument("--tag", default="", help="label of this run (kept in the JSON)")
    ap.add_argument("--json", default="-", help="output JSON path ('-': one line on stdout)")
    ap.add_argument("--png", default=None, help="plot of N against latency and throughput")
    args = ap.parse_args(argv)
    quiet_logging()
    loads = [x for x in args.loads.split(",") if x]
    ns = [int(x) for x in args.actors.split(",") if x]
    args.max_actors = max(ns)
    work = Path(args.work or tempfile.mkdtemp(prefix="tandem-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_pi0(work, args.chunk, args.episode_steps) if "camera" in loads else None
    # --compare-root: each point twice, interleaved, the learner from that tree first ("before")
    roots = ([("before", args.compare_root), ("after", args.learner_root)] if args.compare_root
             else [(args.tag, args.learner_root)])
    points, base = [], []
    for load in loads:
        for n in ns:
            for tag, root in roots:
                args.tag, args.learner_root = tag, root
                print(f"[fleet] {load} N={n} {tag}: load avg {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                p = run_point(load, n, args, work, ckpt)
                print(f"[fleet]   act p50 {p['act_ms']['p50']:.1f} ms p99 {p['act_ms']['p99']:.1f} ms, "
                      f"rate kept by {p['rate']['kept_fraction']:.0%}, batch {p['infer_batch']:.1f}, "
                      f"ingest {p['ingest']['records_per_s']:.0f} rec/s", file=sys.stderr, flush=True)
                (base if tag == "before" and args.compare_root else points).append(p)
                if args.json != "-":  # what is done so far survives a later failure
                    Path(args.json + ".partial").write_text(json.dumps({"points": points, "before": base}))
    out = {"command": "python -m tools.bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "hardware": {"cpus": os.cpu_count(), "gpu": None, "machine": platform.machine(),
                        "kernel": platform.release(), "note": "2-core VM shared with other work, no GPU;"
                        " the simulated robots run on the same cores as the learner"},
           "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
           "points": points, "saturation": verdict(points)}
    if base:
        out["before"] = {"learner_root": args.compare_root, "points": base, "saturation": verdict(base),
                         "comparison": compare(base, points)}
    emit_json(out, args.json)
    if args.png:
        plot(out, args.png)
    return out


if __name__ == "__main__":
    main()
