"""The :class:`InterventionWrapper`: a human takes over the action and labels episodes
(see :mod:`envs.intervention` for the info keys it sets)."""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np

from envs.intervention.base import GENERIC_DIM, InterventionSource, InterventionState


def default_action_map(action_dim: int) -> list[int]:
    if action_dim == GENERIC_DIM:
        return list(range(GENERIC_DIM))
    if action_dim == 4:
        return [0, 1, 2, 6]
    if action_dim == 3:
        return [0, 1, 2]
    raise ValueError(f"no default mapping from the 7-D device command to a {action_dim}-D action; "
                     "give action_map (indices into [dx, dy, dz, droll, dpitch, dyaw, gripper])")


class InterventionWrapper(gym.Wrapper):
    """Let a human take over the action and label episodes (see the module docstring).

    ``label_reward``: a ``success`` label gives reward 1.0 on that step.
    """

    def __init__(self, env: gym.Env, source: InterventionSource, *, action_map: Sequence[int] | None = None,
                 label_reward: bool = True):
        super().__init__(env)
        self.source = source
        dim = int(env.action_space.shape[0])
        self.action_map = list(action_map) if action_map is not None else None
        self._dim = dim
        self.label_reward = bool(label_reward)
        self._t = 0
        self._obs = None
        self.quit_requested = False

    def _to_env(self, state: InterventionState) -> np.ndarray:
        a = np.asarray(state.action, np.float32).reshape(-1)
        if not state.env_space:
            idx = self.action_map if self.action_map is not None else default_action_map(self._dim)
            a = a[idx]
        if a.shape != self.env.action_space.shape:
            raise ValueError(f"human action has shape {a.shape}, env wants {self.env.action_space.shape}")
        return np.clip(a, self.env.action_space.low, self.env.action_space.high).astype(np.float32)

    def reset(self, **kwargs):
        self._t = 0
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        info["intervened"] = False
        return obs, info

    def step(self, action):
        state = self.source.poll(self._t, self._obs)
        policy_action = np.asarray(action, np.float32)
        applied = self._to_env(state) if state.active and state.action is not None else policy_action
        obs, reward, terminated, truncated, info = self.env.step(applied)
        self._t += 1
        self._obs = obs
        intervened = bool(state.active and state.action is not None)
        info["intervened"] = intervened
        info["policy_action"] = policy_action
        if intervened:
            # what reached the robot: after a SafetyWrapper beneath, its safe version
            info["human_action"] = np.asarray(info.get("applied_action", applied), np.float32)
        if "success" in state.events:
            info["is_success"] = True
            info["human_label"] = "success"
            terminated = True
            if self.label_reward:
                reward = 1.0
        elif "failure" in state.events:
            info["is_success"] = False
            info["human_label"] = "failure"
            terminated = True
        if "reset" in state.events and not terminated:
            info["human_reset"] = True
            truncated = True
        if "quit" in state.events:
            info["quit"] = True
            self.quit_requested = True
            truncated = truncated or not terminated
        return obs, reward, bool(terminated), bool(truncated), info

    def close(self):
        try:
            self.source.close()
        finally:
            super().close()
