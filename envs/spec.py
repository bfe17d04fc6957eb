"""What an actor and a learner must agree on about an environment.

An :class:`EnvSpec` is read off a gymnasium env whose observation space is a Dict with
the common keys of :mod:`data.schema` (``observation.state``, ``observation.images.*``,
optionally ``task``) and whose action space is a float Box in [-1, 1]^A.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import gymnasium as gym
import numpy as np

from data.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK


@dataclass(frozen=True)
class EnvSpec:
    state_dim: int
    action_dim: int
    cameras: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    has_task: bool = False
    max_episode_steps: int = 0

    @property
    def image_keys(self) -> list[str]:
        return [OBS_IMAGE_PREFIX + c for c in sorted(self.cameras)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cameras"] = {k: list(v) for k, v in sorted(self.cameras.items())}
        return d

    @classmethod
    def from_env(cls, env: gym.Env) -> "EnvSpec":
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
        return cls(
            state_dim=int(space.spaces[OBS_STATE].shape[0]),
            action_dim=int(act.shape[0]),
            cameras=cams,
            has_task=TASK in space.spaces,
            max_episode_steps=int(steps),
        )


def config_hash(spec: EnvSpec, *, env_name: str, policy_name: str, chunk: int) -> str:
    """Short hash of everything an actor and the learner must agree on."""
    blob = json.dumps(
        {"env": env_name, "spec": spec.to_dict(), "policy": policy_name, "chunk": int(chunk)},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
