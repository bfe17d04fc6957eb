"""0/1 reward from the env's (or a human's) success flag: :class:`SuccessReward`."""

from __future__ import annotations

import gymnasium as gym


class SuccessReward(gym.Wrapper):
    """Reward 1.0 when ``info[key]`` is true, else 0.0; terminate on success if asked.

    ``info[key]`` comes from the env (LIBERO, gym-hil), a classifier, or a human label
    (:mod:`envs.intervention`)."""

    def __init__(self, env: gym.Env, key: str = "is_success", terminate: bool = True):
        super().__init__(env)
        self.key = key
        self.terminate_on_success = terminate

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        success = bool(info.get(self.key, False))
        info["is_success"] = success
        if success and self.terminate_on_success:
            terminated = True
        return obs, float(success), bool(terminated), bool(truncated), info
