"""Deterministic interventions from a schedule or a function: tests, simulated demos."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from envs.intervention.base import EVENTS, InterventionSource, InterventionState


class ScriptedIntervention(InterventionSource):
    """Deterministic interventions for tests and simulated demos.

    ``takeover``: steps (an iterable of ints or ``range``s) during which the human holds
    control; ``action``: the human action then, a fixed array or ``fn(step, obs) ->
    array``; ``events``: ``{step: "success" | "failure" | "reset" | "quit"}``; ``env_space``:
    whether ``action`` is in the env's action space (True) or the generic 7-D command.
    Steps count from 0 at each episode start (the wrapper passes them).
    """

    def __init__(self, takeover: Iterable[int] | Callable[[int], bool] = (),
                 action: np.ndarray | Sequence[float] | Callable[[int, Any], np.ndarray] | None = None,
                 events: Mapping[int, str | Iterable[str]] | None = None, env_space: bool = True):
        if callable(takeover):
            self._takeover = takeover
        else:
            steps: set[int] = set()
            for t in takeover:
                steps.update(t if isinstance(t, range) else [int(t)])
            self._takeover = steps.__contains__
        self._action = action
        self._events = {int(k): ({v} if isinstance(v, str) else set(v)) for k, v in (events or {}).items()}
        for evs in self._events.values():
            bad = evs - set(EVENTS)
            if bad:
                raise ValueError(f"unknown events {bad}; use {EVENTS}")
        self.env_space = env_space

    def poll(self, step: int = 0, obs=None) -> InterventionState:
        active = bool(self._takeover(step))
        act = None
        if active:
            a = self._action(step, obs) if callable(self._action) else self._action
            if a is None:
                raise ValueError("ScriptedIntervention took over without an action")
            act = np.asarray(a, dtype=np.float32)
        return InterventionState(active, act, set(self._events.get(step, ())), self.env_space)
