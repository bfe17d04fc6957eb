"""Cheap MuJoCo tasks in the Tandem layout: what a newcomer trains on a CPU.

Two gymnasium MuJoCo envs, wrapped the same way (:class:`TandemMujoco`):

* observation ``Dict({"observation.state": Box(float32, [S])})``: the MuJoCo env's own
  observation vector, cast to float32;
* action float32 ``Box([-1, 1]^A)``, clipped and rescaled affinely to the actuator bounds;
* reward: the MuJoCo env's own;
* ``info["is_success"]`` (bool) on every step and on reset; an episode counts as a success
  when the info of its last step says so;
* termination as the MuJoCo env decides it, the time limit as a ``TimeLimit`` truncation
  (added by ``gym.make``): the two are never merged.

``tandem/Reacher-v0`` (:func:`make_reacher_env`) -- gymnasium ``Reacher-v5``, S=10, A=2,
50 steps. Success at a step: the fingertip is within ``success_threshold`` metres of the
target (default 0.05 m; the arm reaches 0.21 m and targets lie within 0.2 m of the base).
Measured over 2000 episodes, a uniform-random policy ends within 0.05 m 6.5% of the time
(0.02 m: 0.9%, 0.03 m: 2.3%). Reacher never terminates. It learns, but slowly for a CPU
demo: SAC reached ~30-50% success after 3.5-7.5k steps (several minutes on one thread).

``tandem/InvertedPendulum-v0`` (:func:`make_inverted_pendulum_env`) -- gymnasium
``InvertedPendulum-v5``, S=4, A=1 (force in [-3, 3] N), 100 steps (4 s) by default instead
of 1000. Reward +1 per step with the pole up; the episode *terminates* when the pole
leaves +-0.2 rad. Success at a step: the pole has been kept up for ``success_steps``
steps (default: the time limit), so a successful episode is one that reaches its time
limit without falling. A uniform-random policy falls after ~6.5 steps (max 25 in 200
episodes): it never succeeds. This is the task SAC learns in about a minute on one thread.

Importing this module registers both ids, so ``gym.make("tandem/Reacher-v0")`` works.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.mujoco.inverted_pendulum_v5 import InvertedPendulumEnv
from gymnasium.envs.mujoco.reacher_v5 import ReacherEnv

from data.core.schema import OBS_STATE

REACHER_ID = "tandem/Reacher-v0"
PENDULUM_ID = "tandem/InvertedPendulum-v0"
ENV_ID = REACHER_ID
DEFAULT_SUCCESS_THRESHOLD = 0.05
DEFAULT_MAX_EPISODE_STEPS = 50
PENDULUM_MAX_EPISODE_STEPS = 100


class TandemMujoco(gym.Wrapper):
    """A MuJoCo env (without time limit) in the Tandem observation/action layout.

    Subclasses define :meth:`_success`. ``seed``, if given, seeds the first ``reset()``
    called without a seed and the action space, so ``make_*_env(seed=s)`` is reproducible.
    """

    def __init__(self, env: gym.Env, *, seed: int | None = None):
        super().__init__(env)
        inner = env.observation_space
        self.observation_space = gym.spaces.Dict({
            OBS_STATE: gym.spaces.Box(-np.inf, np.inf, shape=inner.shape, dtype=np.float32),
        })
        act = env.action_space
        self._act_low = act.low.astype(np.float64)
        self._act_high = act.high.astype(np.float64)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=act.shape, dtype=np.float32)
        self._pending_seed = seed
        if seed is not None:
            self.action_space.seed(seed)

    def _success(self, info: dict[str, Any], *, stepped: bool, terminated: bool) -> bool:
        """Success at this moment (``stepped``: after a step, else after a reset); may add
        diagnostics to ``info``."""
        raise NotImplementedError

    def _on_reset(self) -> None:
        pass

    def _obs(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        return {OBS_STATE: np.asarray(obs, dtype=np.float32)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and self._pending_seed is not None:
            seed = self._pending_seed
        self._pending_seed = None
        obs, info = self.env.reset(seed=seed, options=options)
        self._on_reset()
        info = dict(info)
        info["is_success"] = self._success(info, stepped=False, terminated=False)
        return self._obs(obs), info

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(self.action_space.shape), -1.0, 1.0)
        a = self._act_low + (a + 1.0) * 0.5 * (self._act_high - self._act_low)
        obs, reward, terminated, truncated, info = self.env.step(a.astype(np.float32))
        info = dict(info)
        info["is_success"] = self._success(info, stepped=True, terminated=bool(terminated))
        return self._obs(obs), float(reward), bool(terminated), bool(truncated), info


class TandemReacher(TandemMujoco):
    """Reacher-v5; ``info["distance"]`` is the fingertip-target distance (m)."""

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


class TandemInvertedPendulum(TandemMujoco):
    """InvertedPendulum-v5; ``info["steps_up"]`` counts the steps the pole has stayed up."""

    def __init__(self, env: gym.Env, *, success_steps: int = PENDULUM_MAX_EPISODE_STEPS,
                 seed: int | None = None):
        super().__init__(env, seed=seed)
        if success_steps < 1:
            raise ValueError(f"success_steps must be >= 1, got {success_steps}")
        self.success_steps = int(success_steps)
        self._steps_up = 0

    def _on_reset(self) -> None:
        self._steps_up = 0

    def _success(self, info: dict[str, Any], *, stepped: bool, terminated: bool) -> bool:
        if stepped:
            self._steps_up = 0 if terminated else self._steps_up + 1
        info["steps_up"] = self._steps_up
        return bool(not terminated and self._steps_up >= self.success_steps)


def _make_reacher(success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                  seed: int | None = None, **reacher_kwargs) -> gym.Env:
    """Registry entry point: the wrapped Reacher without a time limit (gym.make adds it)."""
    return TandemReacher(ReacherEnv(**reacher_kwargs), success_threshold=success_threshold,
                         seed=seed)


def _make_pendulum(success_steps: int = PENDULUM_MAX_EPISODE_STEPS, seed: int | None = None,
                   **pendulum_kwargs) -> gym.Env:
    """Registry entry point: the wrapped pendulum without a time limit (gym.make adds it)."""
    return TandemInvertedPendulum(InvertedPendulumEnv(**pendulum_kwargs),
                                  success_steps=success_steps, seed=seed)


def make_reacher_env(max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
                     success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                     seed: int | None = None, **reacher_kwargs) -> gym.Env:
    """``tandem/Reacher-v0`` with a ``max_episode_steps`` truncation (see module docstring).

    ``reacher_kwargs`` go to gymnasium's ``ReacherEnv`` (e.g. ``render_mode``,
    ``reward_control_weight``).
    """
    return gym.make(REACHER_ID, max_episode_steps=int(max_episode_steps),
                    success_threshold=success_threshold, seed=seed, **reacher_kwargs)


def make_inverted_pendulum_env(max_episode_steps: int = PENDULUM_MAX_EPISODE_STEPS,
                               success_steps: int | None = None, seed: int | None = None,
                               **pendulum_kwargs) -> gym.Env:
    """``tandem/InvertedPendulum-v0`` with a ``max_episode_steps`` truncation.

    ``success_steps`` defaults to ``max_episode_steps`` (success = never fell).
    """
    return gym.make(PENDULUM_ID, max_episode_steps=int(max_episode_steps),
                    success_steps=int(success_steps or max_episode_steps), seed=seed,
                    **pendulum_kwargs)


if REACHER_ID not in gym.registry:
    gym.register(id=REACHER_ID, entry_point="envs.reacher:_make_reacher",
                 max_episode_steps=DEFAULT_MAX_EPISODE_STEPS)
if PENDULUM_ID not in gym.registry:
    gym.register(id=PENDULUM_ID, entry_point="envs.reacher:_make_pendulum",
                 max_episode_steps=PENDULUM_MAX_EPISODE_STEPS)
