"""Actor processes of the VLA serving bench: each runs the real ``actor.client.LearnerClient``
in a closed act loop (``python -m tools.bench.policy --client ...``), started together.

Without an env an actor sends the same random observation again as soon as its reply came (a
simulator that takes no time) or once every ``period`` s (a robot's rate). With ``env`` (an env
config, :func:`envs.registry.make_env`) it is a closed-loop simulated actor: it acts on the env's
own observation and instruction, runs ``execute`` actions of each chunk in the env (resetting it
when an episode ends) and only then asks again, so the time between its requests is the
simulator's. With ``port=None`` (``local``) the simulated actors step their envs on random
chunks and ask no learner: the simulators' own load on the box (their CPU, and their
rendering where it runs on the GPU), with no serving beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import HOST, ROOT, percentile, random_obs

TASK = "pick up the black bowl between the plate and the ramekin and place it on the plate"
HASH = "bench"


def client_main(a) -> None:
    """One actor (light: numpy, zmq, the actor client); ``a`` holds the --client arguments."""
    import zmq

    from actor.client import LearnerClient
    from actor.spool import Spool

    cams = json.loads(a.cams)
    sim = Sim(json.loads(a.env), int(a.execute), seed=a.seed) if getattr(a, "env", None) else None
    if getattr(a, "local", False):
        if sim is None:
            raise SystemExit("--local: a local actor steps an env (--env)")
        local_main(a, sim)
        return
    obs, tasks = sim.obs() if sim else (random_obs(a.state_dim, cams, seed=a.seed), [TASK])
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        cl = LearnerClient(ctx=ctx, host=HOST, port=a.port, actor_id=a.actor_id, config_hash=HASH,
                           spool=Spool(Path(tmp) / "spool", fsync=False), timeout_s=120.0, heartbeat_s=60.0)
        cl.connect(give_up_after_s=60)
        actions, *_ = cl.act(obs, tasks)  # warm-up, also registers this actor as active
        print("ready", flush=True)
        sys.stdin.readline()  # all actors start together
        lat, versions, t_end = [], set(), time.perf_counter() + a.seconds
        period = float(getattr(a, "period", 0.0) or 0.0)  # > 0: a request every period s (a robot's rate)
        t_next = time.perf_counter()
        while time.perf_counter() < t_end:
            if period > 0:
                time.sleep(max(0.0, t_next - time.perf_counter()))
                t_next += period
            t0 = time.perf_counter()
            actions, v, *_ = cl.act(obs, tasks)  # (actions, version[, extras])
            lat.append((time.perf_counter() - t0) * 1000.0)
            versions.add(int(v))
            if sim is not None:
                obs, tasks = sim.run(actions[0])
        print(json.dumps({"n": len(lat), "lat_ms": lat, "shape": list(actions.shape), "versions": sorted(versions),
                          **(sim.stats() if sim else {})}))
        cl.close()
    if sim is not None:
        sim.env.close()
    ctx.destroy(0)


def local_main(a, sim: "Sim") -> None:
    """A simulated actor with no learner: steps its env on random chunks of ``--execute``
    actions (0: 8) for ``--seconds`` once told to start, then prints its stats."""
    rng = np.random.default_rng(a.seed)
    dim = int(sim.env.action_space.shape[0])
    n = int(a.execute) or 8
    print("ready", flush=True)
    sys.stdin.readline()
    chunks, t_end = 0, time.perf_counter() + a.seconds
    while time.perf_counter() < t_end:
        sim.run(rng.uniform(-0.5, 0.5, size=(n, dim)).astype(np.float32))
        chunks += 1
    print(json.dumps({"n": chunks, "lat_ms": [], **sim.stats()}), flush=True)
    sim.env.close()


class Sim:
    """One env in a closed loop: ``run(chunk)`` executes ``execute`` of its actions (0: all),
    resets when an episode ends, and returns the next request's (arrays, [task])."""

    def __init__(self, env_cfg: dict, execute: int, seed: int = 0):
        from envs.registry import make_env

        self.env, self.execute, self.seed = make_env(env_cfg), execute, seed
        self.steps = self.episodes = 0
        self.sim_s = 0.0
        self._ob, _ = self.env.reset(seed=seed)

    def obs(self) -> tuple[dict, list[str]]:
        from actor.loop import obs_arrays

        return obs_arrays(self._ob)

    def run(self, chunk: np.ndarray) -> tuple[dict, list[str]]:
        t0 = time.perf_counter()
        for action in chunk[: self.execute or len(chunk)]:
            self._ob, _, terminated, truncated, _ = self.env.step(np.asarray(action, dtype=np.float32))
            self.steps += 1
            if terminated or truncated:
                self.episodes += 1
                self._ob, _ = self.env.reset(seed=self.seed + self.episodes)
                break
        self.sim_s += time.perf_counter() - t0
        return self.obs()

    def stats(self) -> dict:
        return {"env_steps": self.steps, "episodes": self.episodes, "sim_s": self.sim_s}


def run_actors(n: int, port: int | None, seconds: float, state_dim: int, cams: dict, counters=None,
               period: float = 0.0, started=None, env: dict | None = None, execute: int = 0) -> dict:
    """``n`` actor processes in a closed act loop for ``seconds`` (``period`` > 0: each sends a
    request every ``period`` s instead; ``env``: each steps its own env, ``execute`` actions of
    a chunk, between requests), started together once all have connected and been
    served one warm-up request (``started()`` is then called). ``counters()`` -> (forwards,
    requests) of the inference server gives the mean batch size over the timed window.
    ``port=None``: local simulated actors (``env`` needed), no learner; only their sim stats."""
    local = port is None
    if local and not env:
        raise ValueError("run_actors: local actors (port=None) step an env: pass env")
    proc_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tools.bench.policy", "--client", *(["--local"] if local else ["--port", str(port)]),
         "--actor-id", f"bench{i}",
         "--seconds", str(seconds), "--state-dim", str(state_dim), "--cams", json.dumps(cams), "--seed", str(i),
         "--period", str(period)] + (["--env", json.dumps(env), "--execute", str(execute)] if env else []),
        cwd=ROOT, env=proc_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            p.wait(60)
            raise RuntimeError(f"actor process failed to connect (rc {p.returncode})")
    c0 = counters() if counters else (0, 0)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    if started is not None:
        started()
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 240)
        if p.returncode != 0:
            raise RuntimeError(f"actor process failed (rc {p.returncode}): {out[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    c1 = counters() if counters else (1, 1)
    chunks = sum(o["n"] for o in outs)
    res = {"actors": n, "chunks": chunks, "chunks_per_s": chunks / seconds}
    if env:  # the simulators' side: env steps/s over all actors, simulated seconds per chunk
        steps = sum(o["env_steps"] for o in outs)
        res["sim"] = {"env_steps": steps, "env_steps_per_s": steps / seconds,
                      "episodes": sum(o["episodes"] for o in outs),
                      "sim_s_per_chunk": sum(o["sim_s"] for o in outs) / max(1, chunks)}
    if local:
        return res
    lat = np.concatenate([o["lat_ms"] for o in outs])
    res.update({"lat_p50_ms": percentile(lat, 50), "lat_p99_ms": percentile(lat, 99), "lat_p90_ms": percentile(lat, 90),
                "lat_max_ms": float(lat.max()), "reply_shape": outs[0]["shape"],
                "mean_batch": (c1[1] - c0[1]) / max(1, c1[0] - c0[0])})
    return res
