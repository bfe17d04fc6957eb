"""LeRobot's HIL-SERL and Tandem on the same gym-hil task, interleaved, on this machine.

    python -m tools.bench.compare_lerobot --out runs/cmp --setting both --repeats 3 --seconds 240

Each system runs its own learner and one actor as separate processes on 127.0.0.1 (LeRobot:
:mod:`tools.bench.compare_lerobot.lerobot_entry` around ``lerobot.rl.learner`` / ``lerobot.rl.actor``
over gRPC; Tandem: ``python -m learner`` / ``python -m actor`` over ZMQ, the actor in local mode
with its own policy copy, as LeRobot's actor, and ``algo.critic_encoder=shared``).

The setup, the same on both sides and in both settings: gym-hil PandaPickCube (front + wrist
128x128 cameras + 18-D state, 4-D action, 100-step episodes); the same network (LeRobot's
default: a 4-layer stride-2 conv encoder with ``--channels`` channels and learned spatial
pooling, frozen at its random init or trained: ``--freeze-backbone``; ``--latent-dim``
embeddings, actor and critic MLPs ``--hidden``, 2 critics); batch ``--batch``, UTD ``--utd``;
LeRobot's SAC hyperparameters (lr 3e-4, tau 0.005, initial temperature 1, gradient clip 40);
100 env steps before learning; no image augmentation (Tandem has none, so LeRobot's DrQ
random shift is turned off: ``lerobot_entry --drq 0``); the same rendering (``--render``:
gym-hil's scene without shadow map and multisampling, or gym-hil's own full quality; OSMesa
for both where installed). Every child runs with OMP_NUM_THREADS=1.

``--setting`` picks each side's runtime options (``SETTINGS``): ``defaults``: each side's own
(LeRobot pushes weights every 4 s; Tandem publishes every 25 updates, at most one update per
stored env step, frozen-backbone outputs cached); ``best``: LeRobot pushes after every update
(push frequency 0 s), Tandem publishes every update with no cap on updates per env step;
``both`` runs ``defaults`` then ``best``. Each setting runs ``--repeats`` rounds of
``--order`` (A B A B ...). Each run lasts ``--seconds`` after its first env step (start-up
excluded, capped by ``--startup-timeout-s``). The 1-minute load average is sampled every 5 s
throughout.

Writes ``<out>/compare.json`` (per setting: each run's rows, see
:mod:`tools.bench.compare_lerobot.analyze`; per side median, min and max; the ratios of the
medians, > 1: Tandem ahead; load averages) and ``<out>/success.png`` (success against wall
time, :mod:`tools.bench.compare_lerobot.plot`). Logs: ``<out>/<setting>/r<i>/<system>/*.log``,
each line prefixed with the time it was read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tools.bench.compare_lerobot.analyze import (lerobot_rows, parse_events, ratios, summarize,  # noqa: E402
                                                 tandem_rows)
from tools.bench.compare_lerobot.plot import success_plot  # noqa: E402
from tools.experiments.learning_run import free_port, stop_processes  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

#: the task, the same on both sides: its description, each side's options for it, and the names
#: of the result files in ``--out``
TASKS = {
    "pick_cube": {
        "desc": "gym_hil PandaPickCube, front+wrist 128x128 + 18-D state, 4-D action",
        "lerobot": [], "tandem": ["env=gym_hil_pick_cube"],
        "json": "compare.json", "png": "success.png"},
    # state only, gym-hil's dense reward, the cube always at gym-hil's fixed start (LeRobot's
    # gym-hil default; Tandem's env.random_block_position=false), no reset pause (gym-hil's 1 s
    # for a human watching), the gripper action in [-1, 1] on both, both actors unpaced
    "pick_cube_state": {
        "desc": "gym_hil PandaPickCube, state only: 18-D robot state + 3-D cube position, 4-D action, "
                "gym-hil's dense reward, fixed cube start, 100-step episodes",
        "lerobot": ["--obs", "state", "--reward-type", "dense", "--random-block", "0", "--reset-delay-s", "0",
                    "--gripper-pm1", "1", "--fps", "0"],
        "tandem": ["env=gym_hil_pick_cube", "~env.cameras", "+env.cameras={}", "env.include_env_state=true",
                   "env.reward_type=dense", "env.random_block_position=false",
                   "++policy.state_embed_without_images=true"],
        "json": "compare_pick_cube_state.json", "png": "success_pick_cube_state.png"},
    # not gym-hil: gymnasium's MuJoCo cart-pole through Tandem's env code on both sides (LeRobot's
    # actor hosts it in place of gym-hil, lerobot_entry.pendulum_env), both actors unpaced
    "pendulum": {
        "desc": "InvertedPendulum (gymnasium MuJoCo InvertedPendulum-v5 via Tandem's envs.pendulum): 4-D state, "
                "1-D action, 100-step episodes, success = the pole up for all 100 steps",
        "lerobot": ["--obs", "pendulum", "--fps", "0"],
        "tandem": ["env=inverted_pendulum", "++policy.state_embed_without_images=true"],
        "json": "compare_pendulum.json", "png": "success_pendulum.png", "render": False,
        # best: Tandem also keeps its replay in memory only (LeRobot's learner writes none to disk)
        "tandem_best": ["buffer.persist=false"]},
}

#: each side's runtime options per setting (the setup above is the same in all of them)
SETTINGS = {
    "defaults": {"lerobot_push_s": 4.0, "tandem": []},
    "best": {"lerobot_push_s": 0.0, "tandem": ["algo.publish_every=1", "algo.max_update_ratio=0"]},
}


def tandem_publish_every(overrides: list[str]) -> int:
    """The learner's updates per weight version: an override, else config/algo/sac.yaml's."""
    for o in overrides:
        if o.startswith("algo.publish_every="):
            return int(o.split("=", 1)[1])
    import yaml

    return int(yaml.safe_load((ROOT / "config" / "algo" / "sac.yaml").read_text())["publish_every"])


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds, in a thread, for the whole protocol."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), os.getloadavg()[0]))
            self._stop.wait(self._every)

    def between(self, t0: float, t1: float) -> dict | None:
        vals = sorted(v for t, v in self.samples if t0 <= t <= t1)
        if not vals:
            return None
        return {"min": round(vals[0], 2), "median": round(vals[len(vals) // 2], 2),
                "max": round(vals[-1], 2), "n": len(vals)}

    def stop(self) -> None:
        self._stop.set()


class Proc:
    """A child process whose merged output is read by a thread, stamped and logged."""

    def __init__(self, args: list[str], log: Path, env: dict):
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "w")
        self.p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            t = time.time()
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:.3f} {line}")
            self.log.flush()

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.log.close()


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def child_env() -> dict:
    """One thread per process; the same headless GL for both systems' MuJoCo rendering
    (OSMesa where installed, else EGL; Tandem's ``env.gl=auto`` keeps an exported choice)."""
    gl = os.environ.get("MUJOCO_GL") or ("osmesa" if _has_osmesa() else "egl")
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "MUJOCO_GL": gl, "PYOPENGL_PLATFORM": gl}


def _has_osmesa() -> bool:
    import ctypes.util

    return ctypes.util.find_library("OSMesa") is not None


def wait_first_step(started: float, timeout_s: float, has_step, procs: list[Proc]) -> float:
    while not has_step():
        if time.time() - started > timeout_s:
            raise RuntimeError(f"no env step within {timeout_s:.0f} s")
        dead = [p for p in procs if p.p.poll() is not None]
        if dead:
            raise RuntimeError(f"a process exited before the first env step: {dead[0].p.args[:4]}")
        time.sleep(0.5)
    return time.time()


def run_until(deadline: float, procs: list[Proc], every_s: float, tick=None) -> float:
    """Until ``deadline`` or a process exits (``tick`` every ``every_s``); the time it ended."""
    while time.time() < deadline and all(p.p.poll() is None for p in procs):
        if tick is not None:
            tick()
        time.sleep(every_s)
    return time.time()


def run_lerobot(args, out: Path, setting: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    common = ["--out", str(out), "--port", str(port), "--seconds", str(args.seconds + args.startup_timeout_s + 120),
              "--batch", str(args.batch), "--utd", str(args.utd), "--hidden", *map(str, args.hidden),
              "--latent-dim", str(args.latent_dim), "--channels", str(args.channels),
              "--freeze-vision-encoder", str(int(args.freeze_backbone)), "--render", args.render,
              "--push-s", str(SETTINGS[setting]["lerobot_push_s"]), "--drq", "0",
              *TASKS[args.task]["lerobot"]]
    mod = [sys.executable, "-m", "tools.bench.compare_lerobot.lerobot_entry"]
    load = uptime()
    t_start = time.time()
    learner = Proc([*mod, "learner", *common], out / "learner.log", child_env())
    actor = Proc([*mod, "actor", *common], out / "actor.log", child_env())
    try:
        t0 = wait_first_step(t_start, args.startup_timeout_s,
                             lambda: any("CMPEVENT" in ln and '"step"' in ln for _, ln in actor.lines),
                             [learner, actor])
        t_end = run_until(t0 + args.seconds, [learner, actor], 1.0)
    finally:
        stop_processes([actor.p, learner.p], 20)
        actor.close()
        learner.close()
    events = sorted(parse_events(ln for _, ln in learner.lines + actor.lines), key=lambda e: e["t"])
    events = [e for e in events if e["t"] <= t_end]
    rows = lerobot_rows(events, t_end, threshold=args.success_threshold, window=args.success_window)
    return {**rows, "startup_s": round(t0 - t_start, 1), "uptime_before": load, "t0": t0, "t_end": t_end,
            "push_s": SETTINGS[setting]["lerobot_push_s"], "drq": False}


def tandem_overrides(args, out: Path, setting: str = "defaults") -> tuple[list[str], list[str], list[str]]:
    h = "[" + ",".join(map(str, args.hidden)) + "]"
    ch = "[" + ",".join([str(args.channels)] * 4) + "]"
    # ++: set whether or not config/policy/mlp.yaml lists the key (MLPPolicyConfig has them all)
    task = TASKS[getattr(args, "task", "pick_cube")]
    render = [f"env.render_quality={args.render}"] if task.get("render", True) else []
    common = [*task["tandem"], *render, "policy=mlp",
              "policy.image_encoder=pool", f"++policy.cnn_channels={ch}", "policy.pool_features=8",
              f"++policy.image_embed_dim={args.latent_dim}", f"++policy.state_embed_dim={args.latent_dim}",
              f"policy.hidden_dims={h}", "++policy.actor_layer_norm=true",
              f"policy.freeze_backbone={str(bool(args.freeze_backbone)).lower()}", f"run_dir={out / 'run'}"]
    learner = ["algo=sac", "algo.critic_encoder=shared", f"algo.critic_hidden_dims={h}",
               f"algo.batch_size={args.batch}", f"algo.utd_ratio={args.utd}", "algo.learning_starts=100",
               *SETTINGS[setting]["tandem"], *(task.get("tandem_best", []) if setting == "best" else []),
               *getattr(args, "tandem_extra", []), "algo.actor_lr=3e-4", "algo.critic_lr=3e-4", "algo.temp_lr=3e-4", "algo.tau=0.005",
               "algo.init_temperature=1.0", "algo.max_grad_norm=40", "device=cpu",
               "trainer.num_threads=1", "logging.every_s=1", "logging.wandb=disabled", "logging.live=false",
               "buffer.video=false", "trainer.checkpoint_every=0", "trainer.checkpoint_every_s=0",
               f"logging.stats_window={args.success_window}"]
    actor = ["actor_id=a0", "mode=local", "log_every_s=1", "seed=1000", "spool.batch_size=1", "spool.fsync=false"]
    return common, learner, actor


def run_tandem(args, out: Path, setting: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    port, pub, act = free_port(), free_port(), free_port()
    common, lo, ao = tandem_overrides(args, out, setting)
    common += [f"transport.port={port}", f"transport.pub_port={pub}", f"transport.act_port={act}"]
    load = uptime()
    t_start = time.time()
    learner = Proc([sys.executable, "-m", "learner", *common, *lo], out / "learner.log", child_env())
    actor = Proc([sys.executable, "-m", "actor", *common, *ao], out / "actor.log", child_env())
    status_path = out / "run" / "status.json"
    samples: list[dict] = []

    def sample() -> None:
        try:
            st = json.loads(status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        if not samples or samples[-1]["status"] != st:
            samples.append({"t": time.time(), "status": st})

    try:
        def has_step() -> bool:
            sample()
            return bool(samples) and samples[-1]["status"].get("env_steps", 0) > 0

        t0 = wait_first_step(t_start, args.startup_timeout_s, has_step, [learner, actor])
        t_end = run_until(t0 + args.seconds, [learner, actor], 0.25, tick=sample)
    finally:
        stop_processes([actor.p, learner.p], 60)
        actor.close()
        learner.close()
    (out / "status_samples.jsonl").write_text("\n".join(json.dumps(s) for s in samples))
    pe = tandem_publish_every(lo)
    rows = tandem_rows([s for s in samples if s["t"] <= t_end], actor.lines, t_end,
                       threshold=args.success_threshold, window=args.success_window, publish_every=pe)
    return {**rows, "startup_s": round(t0 - t_start, 1), "uptime_before": load, "t0": t0, "t_end": t_end,
            "publish_every": pe, "overrides": {"common": common, "learner": lo, "actor": ao}}


def _logged_lines(path: Path) -> list[tuple[float, str]]:
    """``Proc``'s log lines back as (time read, line)."""
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        t, _, line = raw.partition(" ")
        try:
            out.append((float(t), line))
        except ValueError:
            continue
    return out


def reanalyze_run(run: dict, args) -> dict:
    """One run's rows again from its logs (and Tandem's status samples)."""
    d = Path(run["dir"])
    if run.get("system") == "lerobot":
        lines = _logged_lines(d / "learner.log") + _logged_lines(d / "actor.log")
        events = sorted(parse_events(ln for _, ln in lines), key=lambda e: e["t"])
        rows = lerobot_rows([e for e in events if e["t"] <= run["t_end"]], run["t_end"],
                            threshold=args.success_threshold, window=args.success_window)
    else:
        samples = [json.loads(x) for x in (d / "status_samples.jsonl").read_text().splitlines() if x]
        rows = tandem_rows([s for s in samples if s["t"] <= run["t_end"]], _logged_lines(d / "actor.log"),
                           run["t_end"], threshold=args.success_threshold, window=args.success_window,
                           publish_every=run.get("publish_every", 1))
    return {**run, **rows}


def finish(res: dict, out: Path) -> None:
    """Per-side summaries, the ratios of the medians, the JSON and the plot."""
    task = TASKS[res["args"].get("task", "pick_cube")]
    for st in res["settings"].values():
        st["summary"] = {side: summarize(runs) for side, runs in st["runs"].items()}
        if {"lerobot", "tandem"} <= set(st["summary"]):
            st["ratios_of_medians_tandem_ahead_if_gt_1"] = ratios(st["summary"]["tandem"], st["summary"]["lerobot"])
    (out / task["json"]).write_text(json.dumps(res, indent=1))
    try:
        success_plot(res, out / task["png"])
    except Exception as e:  # noqa: BLE001 - the JSON stands without the plot
        print(f"no plot: {type(e).__name__}: {e}", flush=True)


def reanalyze(out: Path, task: str = "pick_cube") -> dict:
    """The rows again from a finished run's logs and status samples (``--reanalyze``)."""
    res = json.loads((out / TASKS[task]["json"]).read_text())
    res["args"].setdefault("task", task)
    a = argparse.Namespace(**res["args"])
    for st in res["settings"].values():
        for side, runs in st["runs"].items():
            st["runs"][side] = [reanalyze_run(r, a) if "t_end" in r else r for r in runs]
    finish(res, out)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new folder")
    ap.add_argument("--task", default="pick_cube", choices=tuple(TASKS),
                    help="pick_cube: gym-hil PandaPickCube from two 128x128 cameras + state, sparse "
                         "reward (compare.json, success.png); pick_cube_state: state only (+ cube "
                         "position), gym-hil's dense reward, fixed cube start "
                         "(compare_pick_cube_state.json, success_pick_cube_state.png)")
    ap.add_argument("--setting", default="defaults", choices=(*SETTINGS, "both"),
                    help="each side's runtime options (SETTINGS); both: defaults then best")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of --order per setting")
    ap.add_argument("--seconds", type=float, default=240.0, help="steady run per system")
    ap.add_argument("--startup-timeout-s", type=float, default=400.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--utd", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    ap.add_argument("--latent-dim", type=int, default=256)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--freeze-backbone", type=int, default=1,
                    help="both systems: 1 keeps the conv backbone at its random init and trains the "
                         "spatial pooling and heads (LeRobot's default), 0 trains it (critic loss)")
    ap.add_argument("--render", default="fast", choices=("fast", "faithful"),
                    help="both systems: fast (no shadow map / multisampling) or faithful (gym-hil's "
                         "own, LeRobot's default; ~10x slower on a software renderer)")
    ap.add_argument("--success-threshold", type=float, default=0.5)
    ap.add_argument("--success-window", type=int, default=10)
    ap.add_argument("--order", default="lerobot,tandem")
    ap.add_argument("--tandem-extra", nargs="*", default=[],
                    help="more learner overrides for Tandem's runs (ablations, e.g. buffer.persist=false)")
    ap.add_argument("--reanalyze", action="store_true",
                    help="recompute <out>/compare.json and the plot from its logs instead of running")
    args = ap.parse_args(argv)
    if args.reanalyze:
        res = reanalyze(Path(args.out), args.task)
        print(json.dumps({k: v.get("ratios_of_medians_tandem_ahead_if_gt_1") for k, v in res["settings"].items()},
                         indent=1))
        return res
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    settings = list(SETTINGS) if args.setting == "both" else [args.setting]
    sides = args.order.split(",")
    res: dict = {"task": TASKS[args.task]["desc"],
                 "args": vars(args), "nproc": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
                 "settings": {s: {"options": SETTINGS[s], "runs": {n: [] for n in sides}} for s in settings}}
    load = LoadSampler()
    t_protocol = time.time()
    try:
        for setting in settings:
            for r in range(args.repeats):
                for name in sides:
                    d = out / setting / f"r{r + 1}" / name
                    print(f"== {setting} round {r + 1} {name} ({uptime()})", flush=True)
                    t_run = time.time()
                    try:
                        row = (run_lerobot if name == "lerobot" else run_tandem)(args, d, setting)
                    except Exception as e:  # noqa: BLE001 - reported, the protocol goes on
                        row = {"error": f"{type(e).__name__}: {e}"}
                    row.update(system=name, round=r + 1, dir=str(d), load_1min=load.between(t_run, time.time()))
                    res["settings"][setting]["runs"][name].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "success_curve"}), flush=True)
                    (out / TASKS[args.task]["json"]).write_text(json.dumps(res, indent=1))
    finally:
        load.stop()
        res["load_1min_protocol"] = load.between(t_protocol, time.time())
        res["wall_s"] = round(time.time() - t_protocol, 1)
        finish(res, out)
    print(json.dumps({k: v.get("ratios_of_medians_tandem_ahead_if_gt_1") for k, v in res["settings"].items()},
                     indent=1))
    return res


if __name__ == "__main__":
    main()
