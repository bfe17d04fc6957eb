"""Reading a :class:`data.core.spec.EnvSpec` off a gymnasium env.

The env's observation space must be a Dict with the common keys of :mod:`data.core.schema`
(``observation.state``, ``observation.images.*``, optionally ``task``) and its action space
a 1-D float32 Box in [-1, 1]^A.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.spec import EnvSpec


def spec_from_env(env: gym.Env) -> EnvSpec:
    space = env.observation_space
    if not isinstance(space, gym.spaces.Dict) or OBS_STATE not in space.spaces:
        raise ValueError(
            f"env {env.spec.id if env.spec else env}: observation space must be a Dict with "
            f"{OBS_STATE!r}, got {space}"
        )
    act = env.action_space
    if not isinstance(act, gym.spaces.Box) or act.dtype != np.float32 or len(act.shape) != 1:
        raise ValueError(f"action space must be a 1-D float32 Box, got {act}")
    cams = {
        k[len(OBS_IMAGE_PREFIX):]: tuple(int(x) for x in s.shape)
        for k, s in space.spaces.items()
        if k.startswith(OBS_IMAGE_PREFIX)
    }
    steps = env.spec.max_episode_steps if env.spec and env.spec.max_episode_steps else 0
    return EnvSpec(
        state_dim=int(space.spaces[OBS_STATE].shape[0]),
        action_dim=int(act.shape[0]),
        cameras=cams,
        has_task=TASK in space.spaces,
        max_episode_steps=int(steps),
    )


def camera_strip(obs: dict | None) -> np.ndarray | None:
    """The observation's camera images side by side (an env's ``render()``), None without any."""
    if obs is None:
        return None
    imgs = [v for k, v in obs.items() if k.startswith(OBS_IMAGE_PREFIX)]
    return np.concatenate(imgs, axis=1) if imgs else None


def checked_action(action, shape, dtype=np.float64, low=-1.0, high=1.0) -> np.ndarray:
    """``action`` as an array of ``shape``, refused when not finite, clipped to [low, high]."""
    a = np.asarray(action, dtype=dtype).reshape(shape)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"non-finite action {a}")
    return np.clip(a, low, high)
