"""Execute an action chunk ``[H, A]`` in one call: :class:`ActionChunkWrapper`."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class ActionChunkWrapper(gym.Wrapper):
    """Accept an action chunk ``[H, A]`` and execute its first ``execute`` steps (all of
    them if None), stopping early when the episode ends.

    Returns the last observation, the summed reward, the last terminated/truncated, and
    ``info["chunk"]``: a list with one dict per executed step (``obs`` before the step,
    ``action``, ``reward``, ``terminated``, ``truncated``, ``info``) so the caller can
    record every step as its own transition.
    """

    def __init__(self, env: gym.Env, chunk_size: int, execute: int | None = None):
        super().__init__(env)
        a = env.action_space
        self.chunk_size = int(chunk_size)
        self.execute = self.chunk_size if execute is None else int(execute)
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError("execute must be in 1..chunk_size")
        self.action_space = spaces.Box(
            np.broadcast_to(a.low, (self.chunk_size, *a.shape)),
            np.broadcast_to(a.high, (self.chunk_size, *a.shape)), dtype=a.dtype,
        )
        self._obs = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, chunk):
        chunk = np.asarray(chunk)
        if chunk.ndim == 1:
            chunk = chunk[None]
        steps = []
        total = 0.0
        obs, terminated, truncated, info = self._obs, False, False, {}
        for a in chunk[: self.execute]:
            prev = obs
            obs, r, terminated, truncated, info = self.env.step(a)
            total += float(r)
            steps.append({"obs": prev, "action": np.asarray(a), "reward": float(r),
                          "terminated": bool(terminated), "truncated": bool(truncated), "info": info})
            if terminated or truncated:
                break
        self._obs = obs
        out = dict(info)
        out["chunk"] = steps
        return obs, total, terminated, truncated, out
