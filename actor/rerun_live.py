"""Live rerun stream of an actor: what the policy sees and what was done, step by step.

``rerun=spawn`` starts a local viewer, ``rerun=connect`` streams to a running one
(``rerun_addr``, default rerun's own), ``rerun=save`` writes an ``.rrd`` file
(``rerun_path``; open it later with ``rerun FILE``). Per env step, on the ``step`` (global)
and ``episode_step`` timelines: every camera image (``cameras/<name>``), each executed
action dimension (``action/<d>``), the reward, the intervention flag, the policy version
and the episode id, and the task instruction when it changes. Entity paths match
``tools/view_episode.py``'s where the same thing is shown.

Logging must not slow the control loop much: images are sent as they are (uint8), every
``every`` steps (1 = all); a failing sink is logged once and the stream turns itself off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK

log = logging.getLogger("tandem.actor")

MODES = ("none", "spawn", "connect", "save")


class RerunLive:
    def __init__(self, mode: str, *, actor_id: str, path: str | Path | None = None,
                 addr: str | None = None, every: int = 1):
        if mode not in MODES:
            raise ValueError(f"rerun must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "save" and not path:
            raise ValueError("rerun=save needs rerun_path (the .rrd file to write)")
        if every < 1:
            raise ValueError(f"rerun_every must be >= 1, got {every}")
        import rerun as rr

        self.rr = rr
        self.mode, self.every, self.path = mode, int(every), Path(path) if path else None
        self.rec = rr.RecordingStream(f"tandem_actor_{actor_id}")
        if mode == "spawn":
            rr.spawn(recording=self.rec)
        elif mode == "connect":
            rr.connect_grpc(addr, recording=self.rec)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rr.save(str(self.path), recording=self.rec)
        self._n = 0
        self._task: str | None = None
        self._dead = False
        log.info("rerun: streaming %s", {"spawn": "to a new viewer", "connect": f"to {addr or 'the viewer'}",
                                         "save": f"to {self.path}"}[mode])

    def log_step(self, obs: dict, action: np.ndarray, reward: float, intervened: bool,
                 version: int, episode: int, step: int) -> None:
        self._n += 1
        if self._dead or (self._n - 1) % self.every:
            return
        rr, rec = self.rr, self.rec
        try:
            rr.set_time("step", sequence=self._n - 1, recording=rec)
            rr.set_time("episode_step", sequence=int(step), recording=rec)
            for k, v in obs.items():
                if k.startswith(OBS_IMAGE_PREFIX):
                    rr.log("cameras/" + k[len(OBS_IMAGE_PREFIX):], rr.Image(np.asarray(v, np.uint8)),
                           recording=rec)
            a = np.asarray(action, np.float64).reshape(-1)
            for d in range(a.shape[0]):
                rr.log(f"action/{d}", rr.Scalars(a[d]), recording=rec)
            state = np.asarray(obs.get(OBS_STATE, ()), np.float64).reshape(-1)
            for d in range(min(state.shape[0], 16)):
                rr.log(f"state/{d}", rr.Scalars(state[d]), recording=rec)
            rr.log("reward", rr.Scalars(float(reward)), recording=rec)
            rr.log("flags/intervened", rr.Scalars(float(intervened)), recording=rec)
            rr.log("policy_version", rr.Scalars(float(version)), recording=rec)
            rr.log("episode", rr.Scalars(float(episode)), recording=rec)
            task = str(obs.get(TASK, "") or "")
            if task != self._task:
                rr.log("task", rr.TextLog(task or "(no task)"), recording=rec)
                self._task = task
        except Exception as exc:  # a viewer gone away must never stop the robot
            log.warning("rerun stream failed (%s: %s): turning it off", type(exc).__name__, exc)
            self._dead = True

    def close(self) -> None:
        try:
            self.rec.flush(blocking=True) if hasattr(self.rec, "flush") else None
            self.rr.disconnect(recording=self.rec)
        except Exception:  # pragma: no cover
            pass


def make_rerun(cfg, actor_id: str) -> RerunLive | None:
    """From the actor config's ``rerun``, ``rerun_path``, ``rerun_addr``, ``rerun_every``."""
    mode = str(cfg.get("rerun", "none") or "none")
    if mode == "none":
        return None
    return RerunLive(mode, actor_id=actor_id, path=cfg.get("rerun_path"), addr=cfg.get("rerun_addr"),
                     every=int(cfg.get("rerun_every", 1)))
