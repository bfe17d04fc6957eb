"""The fleet bench's simulated robots: one process runs many actors, each a thread with the
product's own actor code (:class:`actor.loop.ActorLoop` over an :class:`actor.client.LearnerClient`
and an :class:`actor.spool.Spool`), in front of a robot stand-in that steps at a fixed rate.

    python -m tools.bench.fleet_actors  < one JSON line (see :func:`main`), then "go <epoch>"

Started by :mod:`tools.bench.fleet`. The stand-in (:class:`PacedEnv`) sleeps to the next
control tick in ``step`` (a robot's fixed period: the loop's act, record and send run in the
time left), returns pre-rendered frames, and ends episodes by truncation after
``episode_steps``. At the end of the window each actor finishes its episode (so that the
learner can make it durable), waits up to ``drain_s`` for the acks, and the process prints
one JSON line with every actor's figures.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from actor.client import ActError, LearnerClient
from actor.loop import ActorLoop
from actor.spool import Spool
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK

TASK_TEXT = "pick up the black bowl between the plate and the ramekin and place it on the plate"


def frames(cameras: dict, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``n`` camera frames per camera: a smooth scene (gradients), a moving square and mild
    noise, so that codecs and video encoders see something like a camera's picture, not
    white noise (incompressible) or a constant (free)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        views = {}
        for c, (h, w, _) in cameras.items():
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)),
                            np.full((h, w), 96 + 16 * i)], axis=-1).astype(np.int16)
            s = max(4, h // 8)
            top, left = (i * s // 2) % (h - s), (i * s) % (w - s)
            img[top:top + s, left:left + s] = (220, 40, 40)
            img += rng.integers(-4, 5, img.shape, dtype=np.int16)
            views[OBS_IMAGE_PREFIX + c] = np.clip(img, 0, 255).astype(np.uint8)
        out.append(views)
    return out


class PacedEnv:
    """A robot stand-in at ``hz``: ``step`` returns at the next control tick (a step that comes
    later than a whole period restarts the schedule from now: the lost ticks are the missed
    rate). After :attr:`wind_down` is set the episode in progress ends at the next step, and
    the next reset marks the actor :attr:`done`."""

    def __init__(self, spec: dict, hz: float, episode_steps: int, frames_: list[dict], seed: int):
        self.period = 1.0 / hz
        self.episode_steps = int(episode_steps)
        self.frames = frames_
        self.state_dim, self.has_task = int(spec["state_dim"]), bool(spec.get("has_task"))
        self.rng = np.random.default_rng(seed)
        self.t = 0
        self.i = seed
        self.next = 0.0
        self.steps = 0
        self.late = 0  # steps that came more than a period after their tick
        self.wind_down = False
        self.done = False

    def _obs(self) -> dict:
        self.i += 1
        obs = {OBS_STATE: self.rng.uniform(-1, 1, self.state_dim).astype(np.float32),
               **self.frames[self.i % len(self.frames)]}
        if self.has_task:
            obs[TASK] = TASK_TEXT
        return obs

    def reset(self, *, seed=None, options=None):
        if self.wind_down:
            self.done = True
        self.t = 0
        self.next = time.monotonic()
        return self._obs(), {}

    def step(self, action):
        self.next += self.period
        now = time.monotonic()
        if self.next > now:
            time.sleep(self.next - now)
        elif now - self.next > self.period:
            self.next = now
            self.late += 1
        self.t += 1
        self.steps += 1
        truncated = self.t >= self.episode_steps or self.wind_down
        return self._obs(), 0.0, False, truncated, {}

    def close(self) -> None:
        pass


class CountingSpool(Spool):
    """The actor's spool, counting what it appended (records and bytes on the wire)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records_added = 0
        self.bytes_added = 0

    def append(self, batch) -> None:
        before = self.nbytes
        super().append(batch)
        self.bytes_added += self.nbytes - before
        self.records_added += len(batch)


class SimActor:
    """One simulated robot: its client, spool, stand-in and loop, run on a thread of its own
    (ZMQ sockets stay with the thread that made them)."""

    def __init__(self, cfg: dict, actor_id: str, index: int, ctx: zmq.Context, frames_: list[dict]):
        self.cfg, self.actor_id, self.ctx = cfg, actor_id, ctx
        self.index = index
        self.frames = frames_
        self.lat_ms: list[float] = []
        self.lat_t: list[float] = []  # when each act started (monotonic)
        self.failures = 0
        self.error: str | None = None
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._main, name=f"sim-{actor_id}", daemon=True)

    def _act(self, arrays, tasks, deterministic):
        t0 = time.perf_counter()
        try:
            out = self.client.act(arrays, tasks, deterministic=deterministic)
        except ActError:
            self.failures += 1
            raise
        self.lat_t.append(time.monotonic())
        self.lat_ms.append((time.perf_counter() - t0) * 1000.0)
        return out

    def _main(self) -> None:
        cfg = self.cfg
        try:
            self.spool = CountingSpool(Path(cfg["spool_root"]) / self.actor_id, fsync=False,
                                       cache_bytes=cfg["spool_cache_mb"] << 20,
                                       spare_bytes=cfg["spool_cache_mb"] << 20)
            self.client = LearnerClient(ctx=self.ctx, host="127.0.0.1", port=cfg["port"],
                                        actor_id=self.actor_id, config_hash=cfg["config_hash"],
                                        spool=self.spool, timeout_s=cfg["timeout_s"],
                                        heartbeat_s=cfg["heartbeat_s"])
            self.client.connect(give_up_after_s=cfg["connect_s"])
        except Exception as exc:  # noqa: BLE001 - reported, the process goes on
            self.error = f"connect: {type(exc).__name__}: {exc}"
            self.connected.set()
            return
        self.connected.set()
        self.env = PacedEnv(cfg["spec"], cfg["hz"], cfg["episode_steps"], self.frames,
                            seed=cfg["seed"] + self.index)
        self.loop = ActorLoop(self.env, self.client, self._act, actor_id=self.actor_id,
                              batch_size=cfg["batch_records"], log_every_s=1e9,
                              get_job=self.client.get_job if self.client.jobs else None)
        START.wait()
        # robots are not in step: each starts at its own phase of the control period
        time.sleep(max(0.0, T0 - time.monotonic() + (self.index * 0.618034 % 1.0) * cfg["phase_s"]))
        try:
            self.loop.run(stop=lambda: self.env.done)
            deadline = time.monotonic() + cfg["drain_s"]
            while len(self.spool) and time.monotonic() < deadline:
                self.client.poll(0.1)
        except Exception as exc:  # noqa: BLE001
            self.error = f"run: {type(exc).__name__}: {exc}"
        finally:
            self.client.close()

    def result(self, w0: float, w1: float) -> dict:
        """Figures of the window [w0, w1] (monotonic) and of the whole run."""
        t = np.asarray(self.lat_t)
        lat = np.asarray(self.lat_ms)[(t >= w0) & (t < w1)] if len(t) else np.zeros(0)
        env = getattr(self, "env", None)  # (None when it never connected)
        sp = getattr(self, "spool", None)
        return {
            "actor": self.actor_id, "error": self.error,
            "lat_ms": [round(float(x), 3) for x in lat],
            "window_steps": int(self.window_steps) if hasattr(self, "window_steps") else 0,
            "steps": env.steps if env else 0, "late_steps": env.late if env else 0,
            "act_failures": self.failures,
            "records": sp.records_added if sp is not None else 0,
            "bytes": sp.bytes_added if sp is not None else 0,
            "acked": (sp.acked + 1) if sp is not None else 0,
            "pending": len(sp) if sp is not None else 0,
            "reconnects": self.client.reconnects if hasattr(self, "client") else 0,
        }


START = threading.Event()
T0 = 0.0


def main() -> None:
    global T0
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    cfg = json.loads(sys.stdin.readline())
    # the robots stand in for machines of their own: on the learner's cores they yield to it
    os.nice(int(cfg.get("nice", 0)))
    sys.setswitchinterval(cfg.get("switch_interval_s", 0.001))  # the harness's GIL hand-offs
    ctx = zmq.Context()
    pics = frames({k: tuple(v) for k, v in cfg["spec"].get("cameras", {}).items()}, 4, cfg["seed"])
    sims = [SimActor(cfg, a, cfg["first_index"] + i, ctx, pics) for i, a in enumerate(cfg["actors"])]
    for s in sims:
        s.thread.start()
    for s in sims:
        s.connected.wait()
    errors = [s.error for s in sims if s.error]
    print(json.dumps({"ready": len(sims) - len(errors), "errors": errors[:5]}), flush=True)
    line = sys.stdin.readline().split()  # "go <seconds from now>"
    T0 = time.monotonic() + float(line[1])
    START.set()
    w0, w1 = T0 + cfg["warmup_s"], T0 + cfg["seconds"]
    time.sleep(max(0.0, w0 - time.monotonic()))
    s0 = [s.env.steps if hasattr(s, "env") else 0 for s in sims]
    time.sleep(max(0.0, w1 - time.monotonic()))
    for s, n0 in zip(sims, s0):
        s.window_steps = (s.env.steps if hasattr(s, "env") else 0) - n0
        if hasattr(s, "env"):
            s.env.wind_down = True
    for s in sims:
        s.thread.join(cfg["drain_s"] + 60)
    print(json.dumps({"actors": [s.result(w0, w1) for s in sims], "window_s": w1 - w0,
                      "pid": os.getpid()}), flush=True)
    ctx.destroy(0)


if __name__ == "__main__":
    main()
