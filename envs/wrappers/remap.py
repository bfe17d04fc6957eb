"""Map a foreign observation dict onto the common schema (:class:`ObsRemap`), and the
gymnasium space of the ``task`` entry (:data:`TEXT_SPACE`) every env uses."""

from __future__ import annotations

import string
from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK

TEXT_SPACE = spaces.Text(max_length=512, charset=string.printable)  # the "task" entry


def _get_path(obs: Mapping, path: str):
    """``"pixels/front"`` or ``"pixels.front"`` looks up nested dicts (exact keys first)."""
    if path in obs:
        return obs[path]
    cur: Any = obs
    for part in path.replace("/", ".").split("."):
        cur = cur[part]
    return cur


def _space_at(space: spaces.Space, path: str) -> spaces.Space:
    if isinstance(space, spaces.Dict) and path in space.spaces:
        return space.spaces[path]
    cur = space
    for part in path.replace("/", ".").split("."):
        cur = cur.spaces[part]  # type: ignore[attr-defined]
    return cur


class ObsRemap(gym.ObservationWrapper):
    """Map an env's own observation dict onto the common schema.

    ``state``: list of source paths concatenated (as float32) into ``observation.state``;
    ``images``: ``{camera_name: source_path}``; ``task``: a fixed instruction, or
    ``task_key`` a source path holding it. Paths may be nested: ``"pixels/front"``.
    """

    def __init__(self, env: gym.Env, *, state: Sequence[str], images: Mapping[str, str] | None = None,
                 task: str | None = None, task_key: str | None = None):
        super().__init__(env)
        self.state_paths = list(state)
        self.image_paths = dict(images or {})
        self.task = task
        self.task_key = task_key
        src = env.observation_space
        dim = 0
        for p in self.state_paths:
            dim += int(np.prod(_space_at(src, p).shape))
        new: dict[str, spaces.Space] = {OBS_STATE: spaces.Box(-np.inf, np.inf, (dim,), np.float32)}
        for cam, p in self.image_paths.items():
            sp = _space_at(src, p)
            new[OBS_IMAGE_PREFIX + cam] = spaces.Box(0, 255, tuple(sp.shape), np.uint8)
        if task is not None or task_key is not None:
            new[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(new)

    def observation(self, obs):
        out: dict[str, Any] = {
            OBS_STATE: np.concatenate(
                [np.asarray(_get_path(obs, p), dtype=np.float32).reshape(-1) for p in self.state_paths]
            ) if self.state_paths else np.zeros(0, np.float32)
        }
        for cam, p in self.image_paths.items():
            out[OBS_IMAGE_PREFIX + cam] = np.ascontiguousarray(np.asarray(_get_path(obs, p), dtype=np.uint8))
        if self.task_key is not None:
            out[TASK] = str(_get_path(obs, self.task_key))
        elif self.task is not None:
            out[TASK] = self.task
        return out
