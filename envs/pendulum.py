"""The CPU demo task: gymnasium's MuJoCo cart-pole (``InvertedPendulum-v5``) in the Tandem
layout, and :class:`TandemMujoco`, the wrapper that puts a gymnasium MuJoCo env into that
layout (:mod:`envs.reacher` uses it too).

The layout (:class:`TandemMujoco`):

* observation ``Dict({"observation.state": Box(float32, [S])})``: the MuJoCo env's own
  observation vector, cast to float32;
* action float32 ``Box([-1, 1]^A)``, clipped and rescaled affinely to the actuator bounds;
* reward: the MuJoCo env's own;
* ``info["is_success"]`` (bool) on every step and on reset; an episode counts as a success
  when the info of its last step says so;
* termination as the MuJoCo env decides it, the time limit as a ``TimeLimit`` truncation
  (added by ``gym.make``): the two are never merged;
* ``reset(options={"task_id": 0, "init_state": i})`` (a learner's job): one task, so
  ``task_id`` must be 0; ``init_state`` selects a deterministic initial state (the reset
  noise is drawn from an RNG seeded by ``i``, whatever the seed; see
  :mod:`envs.reset_options`). ``info["task_id"]`` and ``info["init_state"]`` (None without
  one) report them.

``tandem/InvertedPendulum-v0`` (:func:`make_inverted_pendulum_env`) -- S=4, A=1 (force in
[-3, 3] N), 100 steps (4 s) by default instead of 1000. Reward +1 per step with the pole up;
the episode *terminates* when the pole leaves +-0.2 rad. Success at a step: the pole has been
kept up for ``success_steps`` steps (default: the time limit), so a successful episode is one
that reaches its time limit without falling. A uniform-random policy falls after ~6.5 steps
(max 25 in 200 episodes): it never succeeds. This is the task SAC learns in about a minute
on one thread.

Importing this module registers the id (``gym.make("tandem/InvertedPendulum-v0")``); it
imports MuJoCo only when an env is made, so :func:`pendulum_spec` runs without it.
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec
from envs.reset_options import init_state_seed, single_task_init_state

PENDULUM_ID = "tandem/InvertedPendulum-v0"
PENDULUM_MAX_EPISODE_STEPS = 100
PENDULUM_STATE_DIM = 4
PENDULUM_ACTION_DIM = 1


class TandemMujoco(gym.Wrapper):
    """A MuJoCo env (without time limit) in the Tandem observation/action layout.

    Subclasses define :meth:`_success` and ``env_name`` (for error messages). ``seed``, if given, seeds the first ``reset()``
    called without a seed and the action space, so ``make_*_env(seed=s)`` is reproducible.
    """

    env_name = "MuJoCo task"

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
        init_state = single_task_init_state(options, self.env_name)
        if seed is None and self._pending_seed is not None:
            seed = self._pending_seed
        self._pending_seed = None
        if init_state is None:
            obs, info = self.env.reset(seed=seed)
        else:
            # the reset noise from init_state's own RNG; the env's stream (seeded by `seed`
            # if given) is put back untouched
            u = self.env.unwrapped
            if seed is not None:
                gym.Env.reset(u, seed=seed)
            stream = u.np_random
            u.np_random = np.random.default_rng(init_state_seed(init_state))
            try:
                obs, info = self.env.reset()
            finally:
                u.np_random = stream
        self._on_reset()
        info = dict(info)
        info["is_success"] = self._success(info, stepped=False, terminated=False)
        info["task_id"] = 0
        info["init_state"] = init_state
        return self._obs(obs), info

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(self.action_space.shape), -1.0, 1.0)
        a = self._act_low + (a + 1.0) * 0.5 * (self._act_high - self._act_low)
        obs, reward, terminated, truncated, info = self.env.step(a.astype(np.float32))
        info = dict(info)
        info["is_success"] = self._success(info, stepped=True, terminated=bool(terminated))
        return self._obs(obs), float(reward), bool(terminated), bool(truncated), info


class TandemInvertedPendulum(TandemMujoco):
    """InvertedPendulum-v5; ``info["steps_up"]`` counts the steps the pole has stayed up."""

    env_name = "inverted_pendulum"

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


def _make_pendulum(success_steps: int = PENDULUM_MAX_EPISODE_STEPS, seed: int | None = None,
                   **pendulum_kwargs) -> gym.Env:
    """Registry entry point: the wrapped pendulum without a time limit (gym.make adds it)."""
    from gymnasium.envs.mujoco.inverted_pendulum_v5 import InvertedPendulumEnv

    return TandemInvertedPendulum(InvertedPendulumEnv(**pendulum_kwargs),
                                  success_steps=success_steps, seed=seed)


def make_inverted_pendulum_env(max_episode_steps: int = PENDULUM_MAX_EPISODE_STEPS,
                               success_steps: int | None = None, seed: int | None = None,
                               **pendulum_kwargs) -> gym.Env:
    """``tandem/InvertedPendulum-v0`` with a ``max_episode_steps`` truncation.

    ``success_steps`` defaults to ``max_episode_steps`` (success = never fell).
    """
    return gym.make(PENDULUM_ID, max_episode_steps=int(max_episode_steps),
                    success_steps=int(success_steps or max_episode_steps), seed=seed,
                    **pendulum_kwargs)


def pendulum_from_config(cfg: Mapping[str, Any]) -> gym.Env:
    """Factory for :mod:`envs.registry` (``config/env/inverted_pendulum.yaml``)."""
    return make_inverted_pendulum_env(
        max_episode_steps=int(cfg.get("max_episode_steps") or PENDULUM_MAX_EPISODE_STEPS),
        success_steps=cfg.get("success_steps"))


def pendulum_spec(cfg: Mapping[str, Any]) -> EnvSpec:
    """The layout :func:`pendulum_from_config` gives for ``cfg``, without MuJoCo."""
    return EnvSpec(state_dim=PENDULUM_STATE_DIM, action_dim=PENDULUM_ACTION_DIM,
                   max_episode_steps=int(cfg.get("max_episode_steps") or PENDULUM_MAX_EPISODE_STEPS))


if PENDULUM_ID not in gym.registry:
    gym.register(id=PENDULUM_ID, entry_point="envs.pendulum:_make_pendulum",
                 max_episode_steps=PENDULUM_MAX_EPISODE_STEPS)
