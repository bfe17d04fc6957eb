"""Gamepad intervention through pygame's joystick (SDL, works headless). Hold the right
bumper to take over; left stick x/y, right stick z (vertical) and yaw; ``A`` closes, ``B``
opens the gripper; ``Y`` success, ``X`` failure, ``Back`` reset."""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from envs.intervention.base import GENERIC_DIM, DeviceUnavailable, InterventionSource, InterventionState


class GamepadIntervention(InterventionSource):
    """An SDL game controller through pygame (see the module docstring for the layout).

    Axis/button numbers follow SDL's Xbox-style mapping; override with ``axes`` and
    ``buttons`` dicts for other pads.
    """

    AXES = {"lx": 0, "ly": 1, "rx": 3, "ry": 4}
    BUTTONS = {"a": 0, "b": 1, "x": 2, "y": 3, "rb": 5, "back": 6}

    def __init__(self, index: int = 0, *, deadzone: float = 0.1, axes: Mapping[str, int] | None = None,
                 buttons: Mapping[str, int] | None = None):
        self.index = int(index)
        self.deadzone = float(deadzone)
        self.axes = {**self.AXES, **(axes or {})}
        self.buttons = {**self.BUTTONS, **(buttons or {})}
        self._js = None
        self._pygame = None
        self._gripper = -1.0
        self._prev: dict[str, bool] = {}

    def start(self) -> None:
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        try:
            import pygame
        except ImportError as exc:
            raise DeviceUnavailable("gamepad intervention needs pygame (pip install pygame)") from exc
        pygame.init()
        pygame.joystick.init()
        n = pygame.joystick.get_count()
        if n <= self.index:
            pygame.quit()
            raise DeviceUnavailable(
                f"no gamepad #{self.index} found ({n} connected); plug one in or use keyboard intervention")
        self._pygame = pygame
        self._js = pygame.joystick.Joystick(self.index)
        self._js.init()

    def _axis(self, name: str) -> float:
        v = float(self._js.get_axis(self.axes[name])) if self.axes[name] < self._js.get_numaxes() else 0.0
        return 0.0 if abs(v) < self.deadzone else v

    def _button(self, name: str) -> bool:
        i = self.buttons[name]
        return bool(self._js.get_button(i)) if i < self._js.get_numbuttons() else False

    def _edge(self, name: str) -> bool:
        now = self._button(name)
        was = self._prev.get(name, False)
        self._prev[name] = now
        return now and not was

    def poll(self, step: int = 0, obs=None) -> InterventionState:
        if self._js is None:
            raise RuntimeError("call start() first")
        self._pygame.event.pump()
        events = set()
        if self._edge("y"):
            events.add("success")
        if self._edge("x"):
            events.add("failure")
        if self._edge("back"):
            events.add("reset")
        if self._button("a"):
            self._gripper = 1.0
        if self._button("b"):
            self._gripper = -1.0
        if not self._button("rb"):
            return InterventionState(False, None, events)
        a = np.zeros(GENERIC_DIM, np.float32)
        a[0] = -self._axis("ly")    # stick forward = +x
        a[1] = -self._axis("lx")    # stick left = +y
        a[2] = -self._axis("ry")    # right stick up = +z
        a[5] = -self._axis("rx")
        a[6] = self._gripper
        return InterventionState(True, np.clip(a, -1, 1), events)

    def close(self) -> None:
        if self._pygame is not None:
            self._pygame.joystick.quit()
            self._pygame = None
            self._js = None
