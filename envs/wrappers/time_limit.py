"""Episode length limit: :class:`TimeLimit` and :func:`has_time_limit`."""

from __future__ import annotations

from dataclasses import replace

import gymnasium as gym


class TimeLimit(gym.Wrapper):
    """Truncate after ``max_episode_steps`` steps. A step that terminates is never also
    marked truncated; ``info["TimeLimit.truncated"]`` says when the limit cut it."""

    def __init__(self, env: gym.Env, max_episode_steps: int):
        super().__init__(env)
        if max_episode_steps <= 0:
            raise ValueError("max_episode_steps must be positive")
        self.max_episode_steps = int(max_episode_steps)
        self.elapsed_steps = 0

    @property
    def spec(self):
        base = self.env.spec
        if base is None:
            base = gym.envs.registration.EnvSpec(id="tandem/unnamed-v0", entry_point=None)
        return replace(base, max_episode_steps=self.max_episode_steps)

    def reset(self, **kwargs):
        self.elapsed_steps = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.elapsed_steps += 1
        if self.elapsed_steps >= self.max_episode_steps and not terminated:
            truncated = True
            info["TimeLimit.truncated"] = True
        return obs, reward, terminated, truncated, info


def has_time_limit(env: gym.Env) -> bool:
    """True when ``env`` or any wrapper inside it is a time limit (ours or gymnasium's)."""
    e = env
    while isinstance(e, gym.Wrapper):
        if isinstance(e, (TimeLimit, gym.wrappers.TimeLimit)):
            return True
        e = e.env
    return False
