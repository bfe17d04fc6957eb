"""A scripted person: takes over with the env's own demonstrator, ``env.unwrapped.expert_action()``.

It stands in for a human corrector (HG-DAgger style) in simulation: it watches the policy
and drives when the policy goes wrong, so the corrected steps reach the learner as
``intervened`` records, exactly as a person's would. ``intervention.device=expert`` on the
actor (``config/actor.yaml``, section ``intervention.expert``).

When it takes over (``trigger``):

* ``drift``: the policy's action differs from the expert's (L2 distance in the env's action
  space above ``drift_threshold``) on ``drift_steps`` consecutive steps;
* ``step``: at step ``start_step`` of the episode;
* ``always``: every step (a demonstrator).

Once it took over it drives for ``hold_steps`` steps (0: to the end of the episode), then
watches again. It watches only the actor's first ``episodes`` episodes (0: all of them;
counted from the actor's start) and, with ``skip_jobs``, never touches an episode the
learner assigned (an evaluation job: reset with options), so evaluations measure the
policy alone. ``noise`` adds N(0, noise^2) to its actions (an imprecise person).

It needs the env: :meth:`ExpertIntervention.bind` returns the env wrapped in
:class:`ExpertTap`, which shows it every reset (job or not) and every action the policy
proposes. The actor does that for any source with a ``bind`` method.
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np

from envs.intervention.base import InterventionSource, InterventionState

TRIGGERS = ("drift", "step", "always")


class ExpertIntervention(InterventionSource):
    """See the module docstring. Counters: ``takeovers``, ``expert_steps``, ``episodes_watched``."""

    def __init__(self, *, episodes: int = 0, trigger: str = "drift", drift_steps: int = 2,
                 drift_threshold: float = 0.5, start_step: int = 0, hold_steps: int = 0,
                 noise: float = 0.0, skip_jobs: bool = True, seed: int = 0):
        if trigger not in TRIGGERS:
            raise ValueError(f"expert trigger must be one of {TRIGGERS}, got {trigger!r}")
        if min(episodes, drift_steps - 1, start_step, hold_steps) < 0 or noise < 0:
            raise ValueError("expert episodes, start_step, hold_steps, noise must be >= 0, "
                             "drift_steps >= 1")
        self.episodes, self.trigger = int(episodes), trigger
        self.drift_steps, self.drift_threshold = int(drift_steps), float(drift_threshold)
        self.start_step, self.hold_steps = int(start_step), int(hold_steps)
        self.noise, self.skip_jobs = float(noise), bool(skip_jobs)
        self._rng = np.random.default_rng(seed)
        self._expert: Callable[[], np.ndarray] | None = None
        self.takeovers = self.expert_steps = self.episodes_watched = 0
        self._watching = False
        self._policy_action: np.ndarray | None = None
        self._drift = 0
        self._hold_left = 0  # > 0: driving; -1: to the end of the episode

    def bind(self, env: gym.Env) -> gym.Env:
        """Use ``env``'s demonstrator; returns ``env`` wrapped so the expert sees resets and
        the policy's actions (use the returned env)."""
        fn = getattr(env.unwrapped, "expert_action", None)
        if fn is None:
            raise ValueError(f"intervention.device=expert needs an env with a scripted "
                             f"demonstrator (env.unwrapped.expert_action()); "
                             f"{type(env.unwrapped).__name__} has none")
        self._expert = fn
        return ExpertTap(env, self)

    # -- what the tap reports ----------------------------------------------------------------
    def on_reset(self, options: dict | None) -> None:
        job = options is not None
        self._watching = not (job and self.skip_jobs) and (
            self.episodes == 0 or self.episodes_watched < self.episodes)
        if self._watching:
            self.episodes_watched += 1
        self._drift, self._hold_left, self._policy_action = 0, 0, None

    def on_policy_action(self, action: Any) -> None:
        self._policy_action = np.asarray(action, np.float32).reshape(-1)

    # -- the source ----------------------------------------------------------------------------
    def _action(self) -> np.ndarray:
        if self._expert is None:
            raise RuntimeError("ExpertIntervention is not bound to an env (call bind(env))")
        a = np.asarray(self._expert(), np.float32).reshape(-1)
        if self.noise:
            a = np.clip(a + self._rng.normal(0.0, self.noise, a.shape), -1.0, 1.0).astype(np.float32)
        return a

    def _takes_over(self, step: int, expert: np.ndarray) -> bool:
        if self.trigger == "always":
            return True
        if self.trigger == "step":
            return step == self.start_step
        pa = self._policy_action
        far = pa is not None and pa.shape == expert.shape and \
            float(np.linalg.norm(pa - expert)) > self.drift_threshold
        self._drift = self._drift + 1 if far else 0
        return self._drift >= self.drift_steps

    def poll(self, step: int = 0, obs=None) -> InterventionState:
        if not self._watching:
            return InterventionState(False)
        expert = self._action()
        if self._hold_left == 0 and self._takes_over(step, expert):
            self._hold_left = self.hold_steps or -1
            self._drift = 0
            self.takeovers += 1
        if self._hold_left == 0:
            return InterventionState(False)
        if self._hold_left > 0:
            self._hold_left -= 1
        self.expert_steps += 1
        return InterventionState(True, expert, set(), env_space=True)


class ExpertTap(gym.Wrapper):
    """Shows an :class:`ExpertIntervention` each reset's options and each proposed action."""

    def __init__(self, env: gym.Env, expert: ExpertIntervention):
        super().__init__(env)
        self.expert = expert

    def reset(self, **kwargs):
        self.expert.on_reset(kwargs.get("options"))
        return self.env.reset(**kwargs)

    def step(self, action):
        self.expert.on_policy_action(action)
        return self.env.step(action)
