"""Write each episode as a ``.npz`` in the transition layout (:class:`EpisodeRecorder`)
and read it back (:func:`load_episode`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from data.core.schema import STEP_ARRAYS, TASK


class EpisodeRecorder(gym.Wrapper):
    """Write every finished episode to ``<out_dir>/episode_<n>.npz`` in the transition
    layout of :mod:`data.core.schema` (step ``t`` holds obs_t, the action taken and what
    followed; one extra ``is_last`` record holds the final observation), plus
    ``human_action`` [N, A] when an intervention wrapper is inside this one.

    The ``.npz`` has only numeric arrays (load with ``allow_pickle=False``); ``meta`` is
    a JSON string (tasks, episode index, length, return, success, wall time).
    """

    def __init__(self, env: gym.Env, out_dir: str | os.PathLike, *, start_episode: int = 0,
                 on_episode: Callable[[Path, dict], None] | None = None):
        super().__init__(env)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.episode = int(start_episode)
        self.on_episode = on_episode
        self._records: list[dict[str, Any]] = []
        self._obs = None
        self._t0 = 0.0
        self.last_path: Path | None = None

    def reset(self, **kwargs):
        if self._records:
            self._flush(final_obs=self._obs, interrupted=True)
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        self._t0 = time.time()
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        intervened = bool(info.get("intervened", False))
        applied = info.get("human_action") if intervened else action
        rec = {k: v for k, v in self._obs.items()}
        rec.update(
            action=np.asarray(applied, np.float32).reshape(self.env.action_space.shape),
            reward=np.float32(reward), terminated=bool(terminated), truncated=bool(truncated),
            intervened=intervened, is_last=False, success=bool(info.get("is_success", False)),
            policy_version=np.int64(info.get("policy_version", -1)), episode=np.int64(self.episode),
            step=np.int64(len(self._records)),
        )
        self._records.append(rec)
        self._obs = obs
        if terminated or truncated:
            self._flush(final_obs=obs, interrupted=False)
        return obs, reward, terminated, truncated, info

    def _flush(self, final_obs, interrupted: bool) -> None:
        last = {k: v for k, v in final_obs.items()}
        a_shape = self.env.action_space.shape
        last.update(action=np.zeros(a_shape, np.float32), reward=np.float32(0), terminated=False,
                    truncated=interrupted, intervened=False, is_last=True,
                    success=bool(self._records[-1]["success"]), policy_version=np.int64(-1),
                    episode=np.int64(self.episode), step=np.int64(len(self._records)))
        if interrupted:  # cut by a reset: the last real step is marked truncated
            self._records[-1]["truncated"] = True
        recs = self._records + [last]
        arrays: dict[str, np.ndarray] = {}
        for k in recs[0]:
            if k == TASK:
                continue
            stacked = np.stack([np.asarray(r[k]) for r in recs])
            dtype = STEP_ARRAYS.get(k)
            arrays[k] = stacked.astype(dtype, copy=False) if dtype else stacked
        meta = {
            "episode": self.episode, "length": len(self._records),
            "return": float(sum(float(r["reward"]) for r in self._records)),
            "success": bool(any(r["success"] for r in self._records)),
            "interventions": int(sum(bool(r["intervened"]) for r in self._records)),
            "tasks": [str(r.get(TASK, "")) for r in recs], "wall_s": time.time() - self._t0,
            "interrupted": interrupted,
        }
        path = self.out_dir / f"episode_{self.episode:06d}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        os.replace(tmp, path)
        self.last_path = path
        if self.on_episode is not None:
            self.on_episode(path, meta)
        self._records = []
        self.episode += 1

    def close(self):
        if self._records and self._obs is not None:
            self._flush(final_obs=self._obs, interrupted=True)
        super().close()


def load_episode(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Read an :class:`EpisodeRecorder` file: (arrays, meta)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(bytes(z["meta"]).decode())
    return arrays, meta
