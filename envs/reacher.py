"""A MuJoCo 2-link arm reaching a random target (gymnasium ``Reacher-v5``) in the Tandem
layout of :class:`envs.pendulum.TandemMujoco` (state observation, [-1, 1] actions,
``info["is_success"]``, ``reset(options={"task_id": 0, "init_state": i})`` for a learner's
job: ``init_state`` fixes the arm's start and the target, whatever the seed).

``tandem/Reacher-v0`` (:func:`make_reacher_env`) -- S=10, A=2, 50 steps. Success at a step:
the fingertip is within ``success_threshold`` metres of the target (default 0.05 m; the arm
reaches 0.21 m and targets lie within 0.2 m of the base), so a random policy rarely succeeds
(docs/learning.md gives the rate). Reacher never terminates. It is slower to learn than
:mod:`envs.pendulum`, the demo's env.

Importing this module registers the id, so ``gym.make("tandem/Reacher-v0")`` works; MuJoCo is
imported only when an env is made, so :func:`reacher_spec` runs without it.
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from data.core.spec import EnvSpec
from envs.pendulum import TandemMujoco

REACHER_ID = "tandem/Reacher-v0"
ENV_ID = REACHER_ID
DEFAULT_SUCCESS_THRESHOLD = 0.05
DEFAULT_MAX_EPISODE_STEPS = 50
REACHER_STATE_DIM = 10
REACHER_ACTION_DIM = 2


class TandemReacher(TandemMujoco):
    """Reacher-v5; ``info["distance"]`` is the fingertip-target distance (m)."""

    env_name = "reacher"

    def __init__(self, env: gym.Env, *, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                 seed: int | None = None):
        super().__init__(env, seed=seed)
        if success_threshold <= 0:
            raise ValueError(f"success_threshold must be > 0, got {success_threshold}")
        self.success_threshold = float(success_threshold)

    def fingertip_distance(self) -> float:
        """Euclidean distance (m) from the fingertip to the target right now."""
        u = self.env.unwrapped
        return float(np.linalg.norm(u.get_body_com("fingertip") - u.get_body_com("target")))

    def _success(self, info: dict[str, Any], *, stepped: bool, terminated: bool) -> bool:
        dist = self.fingertip_distance()
        info["distance"] = dist
        return bool(dist <= self.success_threshold)


def _make_reacher(success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                  seed: int | None = None, **reacher_kwargs) -> gym.Env:
    """Registry entry point: the wrapped Reacher without a time limit (gym.make adds it)."""
    from gymnasium.envs.mujoco.reacher_v5 import ReacherEnv

    return TandemReacher(ReacherEnv(**reacher_kwargs), success_threshold=success_threshold,
                         seed=seed)


def make_reacher_env(max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
                     success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                     seed: int | None = None, **reacher_kwargs) -> gym.Env:
    """``tandem/Reacher-v0`` with a ``max_episode_steps`` truncation (see module docstring).

    ``reacher_kwargs`` go to gymnasium's ``ReacherEnv`` (e.g. ``render_mode``,
    ``reward_control_weight``).
    """
    return gym.make(REACHER_ID, max_episode_steps=int(max_episode_steps),
                    success_threshold=success_threshold, seed=seed, **reacher_kwargs)


def reacher_from_config(cfg: Mapping[str, Any]) -> gym.Env:
    """Factory for :mod:`envs.registry` (``config/env/reacher.yaml``)."""
    return make_reacher_env(
        max_episode_steps=int(cfg.get("max_episode_steps") or DEFAULT_MAX_EPISODE_STEPS),
        success_threshold=float(cfg.get("success_threshold") or DEFAULT_SUCCESS_THRESHOLD))


def reacher_spec(cfg: Mapping[str, Any]) -> EnvSpec:
    """The layout :func:`reacher_from_config` gives for ``cfg``, without MuJoCo."""
    return EnvSpec(state_dim=REACHER_STATE_DIM, action_dim=REACHER_ACTION_DIM,
                   max_episode_steps=int(cfg.get("max_episode_steps") or DEFAULT_MAX_EPISODE_STEPS))


if REACHER_ID not in gym.registry:
    gym.register(id=REACHER_ID, entry_point="envs.reacher:_make_reacher",
                 max_episode_steps=DEFAULT_MAX_EPISODE_STEPS)
