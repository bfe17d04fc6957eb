"""Actor-side action safety: :class:`SafetyWrapper`."""

from __future__ import annotations

from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_STATE


class SafetyWrapper(gym.ActionWrapper):
    """Actor-side action safety.

    * non-finite actions are replaced by ``safe_action`` (zeros by default) and flagged;
    * actions are clipped to the action space (``clip: true``);
    * with ``workspace_low``/``workspace_high`` (metres, same frame as the end-effector
      position in ``observation.state[ee_pos_index]``), each translation component of the
      action (``action_pos_index``) that would push the end effector further beyond a bound
      is zeroed. The env's own ``ee_pos_index`` / ``action_pos_index`` attributes are used
      when present.

    Sets ``info["safety"]`` to a dict of what it did in that step and
    ``info["applied_action"]`` to the action the env received.
    """

    def __init__(self, env: gym.Env, *, clip: bool = True,
                 workspace_low: Sequence[float] | None = None,
                 workspace_high: Sequence[float] | None = None,
                 ee_pos_index: Sequence[int] | None = None,
                 action_pos_index: Sequence[int] | None = None,
                 safe_action: Sequence[float] | None = None,
                 max_abs_action: float | None = None):
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, spaces.Box):
            raise TypeError("SafetyWrapper needs a Box action space")
        self.low = space.low.astype(np.float64)
        self.high = space.high.astype(np.float64)
        self.clip = bool(clip)
        self.max_abs = None if max_abs_action is None else float(max_abs_action)
        u = env.unwrapped
        self.ws_low = None if workspace_low is None else np.asarray(workspace_low, np.float64)
        self.ws_high = None if workspace_high is None else np.asarray(workspace_high, np.float64)
        self.ee_idx = list(ee_pos_index if ee_pos_index is not None else getattr(u, "ee_pos_index", range(3)))
        self.act_idx = list(action_pos_index if action_pos_index is not None
                            else getattr(u, "action_pos_index", range(3)))
        if (self.ws_low is not None or self.ws_high is not None) and len(self.ee_idx) != len(self.act_idx):
            raise ValueError("ee_pos_index and action_pos_index must have the same length")
        self.safe_action = (np.zeros(space.shape, np.float64) if safe_action is None
                            else np.asarray(safe_action, np.float64))
        self._ee: np.ndarray | None = None
        self._report: dict[str, Any] = {}

    def _remember(self, obs) -> None:
        try:
            self._ee = np.asarray(obs[OBS_STATE], np.float64)[self.ee_idx]
        except (KeyError, IndexError, TypeError):
            self._ee = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._remember(obs)
        return obs, info

    def action(self, action):
        a = np.asarray(action, dtype=np.float64).reshape(self.low.shape).copy()
        rep: dict[str, Any] = {"non_finite": False, "clipped": False, "workspace": False}
        if not np.all(np.isfinite(a)):
            a = self.safe_action.copy()
            rep["non_finite"] = True
        if self.max_abs is not None:
            b = np.clip(a, -self.max_abs, self.max_abs)
            rep["clipped"] |= bool(np.any(b != a))
            a = b
        if self.clip:
            b = np.clip(a, self.low, self.high)
            rep["clipped"] |= bool(np.any(b != a))
            a = b
        if self._ee is not None and (self.ws_low is not None or self.ws_high is not None):
            for j, (ai, pos) in enumerate(zip(self.act_idx, self._ee, strict=True)):
                if self.ws_low is not None and pos <= self.ws_low[j] and a[ai] < 0:
                    a[ai] = 0.0
                    rep["workspace"] = True
                if self.ws_high is not None and pos >= self.ws_high[j] and a[ai] > 0:
                    a[ai] = 0.0
                    rep["workspace"] = True
        self._report = rep
        return a.astype(self.env.action_space.dtype)

    def step(self, action):
        safe = self.action(action)
        obs, reward, terminated, truncated, info = self.env.step(safe)
        info["safety"] = dict(self._report)
        info["applied_action"] = safe
        self._remember(obs)
        return obs, reward, terminated, truncated, info
