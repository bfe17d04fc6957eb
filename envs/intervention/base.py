"""The intervention source protocol: :class:`InterventionSource` is polled once per env
step and answers with an :class:`InterventionState`; :class:`DeviceUnavailable` says a
device or its package is missing. See :mod:`envs.intervention` for the whole picture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

EVENTS = ("success", "failure", "reset", "quit")
GENERIC_DIM = 7


class DeviceUnavailable(RuntimeError):
    """An input device (or the package to read it) is not present."""


@dataclass
class InterventionState:
    active: bool = False
    action: np.ndarray | None = None        # while active: the human's command
    events: set[str] = field(default_factory=set)
    env_space: bool = False                 # action is already in the env's action space


class InterventionSource:
    """Base class: ``start``, then ``poll`` once per step, then ``close``."""

    def start(self) -> None:  # noqa: B027 - optional hook
        pass

    def poll(self, step: int = 0, obs: Mapping[str, Any] | None = None) -> InterventionState:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
