"""Human intervention: input devices that take over the action while held, and labels.

An :class:`InterventionSource` is polled once per env step and answers with an
:class:`InterventionState`: whether the human holds control, the human's action, and
one-shot events (``success``, ``failure``, ``reset``, ``quit``) since the last poll.

Device actions are a generic end-effector command ``[dx, dy, dz, droll, dpitch, dyaw,
gripper]`` in [-1, 1] (gripper -1 open, +1 closed); :class:`InterventionWrapper` maps it
onto the env's action space (7-D: as is; 4-D: ``[dx, dy, dz, gripper]``, gym-hil; 3-D:
``[dx, dy, dz]``; otherwise give ``action_map``). A :class:`ScriptedIntervention` may
produce env-space actions directly.

Sources:

* :class:`KeyboardIntervention`: a terminal in raw (cbreak) mode, no display and no
  ``pynput`` needed. ``i`` toggles takeover; while taking over, ``w/s`` x, ``a/d`` y,
  ``r/f`` z, ``j/l`` yaw, ``u/o`` roll, ``k/m`` pitch (or the arrow keys for x/y), held keys
  count while the terminal's auto-repeat keeps them coming; ``space`` toggles the gripper.
  Hotkeys: ``y`` success, ``n`` failure, ``x`` reset, ``q`` quit.
* :class:`GamepadIntervention`: pygame's joystick (SDL, works headless). Hold the right
  bumper to take over; left stick x/y, right stick z (vertical) and yaw; ``A`` closes,
  ``B`` opens the gripper; ``Y`` success, ``X`` failure, ``Back`` reset.
* :class:`SpaceMouseIntervention`: a 3Dconnexion SpaceMouse through ``hidapi`` (``hid``).
  Moving the cap beyond the dead zone takes over; left button toggles the gripper; the
  right button labels success.
* :class:`ScriptedIntervention`: a schedule or a function of (step, obs): tests, simulated
  demos.

Missing optional packages or devices raise :class:`DeviceUnavailable` with a message
saying what to install or plug in.

:class:`InterventionWrapper` sets ``info["intervened"]`` and ``info["human_action"]`` (the
action actually applied) on every step the human holds control, and ``info["policy_action"]``
(what the policy wanted). A ``success`` label ends the episode with reward 1 and
``info["is_success"] = True``; ``failure`` ends it with ``is_success`` False; ``reset`` ends
it as truncated (``info["human_reset"]``); ``quit`` sets ``info["quit"]``.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import gymnasium as gym
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


# ---------------------------------------------------------------- scripted

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


# ---------------------------------------------------------------- keyboard (terminal)

_KEY_AXES = {
    "w": (0, +1), "s": (0, -1), "a": (1, +1), "d": (1, -1), "r": (2, +1), "f": (2, -1),
    "u": (3, +1), "o": (3, -1), "k": (4, +1), "m": (4, -1), "j": (5, +1), "l": (5, -1),
    "UP": (0, +1), "DOWN": (0, -1), "LEFT": (1, +1), "RIGHT": (1, -1),
}
_KEY_EVENTS = {"y": "success", "n": "failure", "x": "reset", "q": "quit", "\x03": "quit"}


class KeyboardIntervention(InterventionSource):
    """Keys from a terminal in cbreak mode (see the module docstring for the keys).

    ``fd``: the terminal to read (default stdin). A terminal reports presses only, not
    releases, so a motion key counts as held for ``hold_s`` seconds after its latest
    press or auto-repeat (set ``hold_s`` above your terminal's repeat delay, ~0.5 s).
    """

    def __init__(self, fd: int | None = None, *, hold_s: float = 0.6, speed: float = 1.0,
                 echo_help: bool = True):
        self.fd = sys.stdin.fileno() if fd is None else int(fd)
        self.hold_s = float(hold_s)
        self.speed = float(speed)
        self.echo_help = echo_help
        self._lock = threading.Lock()
        self._pressed: dict[str, float] = {}
        self._events: set[str] = set()
        self._takeover = False
        self._gripper = -1.0
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._saved_attrs = None

    def start(self) -> None:
        import termios
        import tty

        if not os.isatty(self.fd):
            raise DeviceUnavailable(
                "keyboard intervention reads a terminal, but this process's input is not a TTY "
                "(run the actor in a terminal, e.g. launch/tmux.sh, or use a gamepad)")
        self._saved_attrs = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        self._thread = threading.Thread(target=self._run, name="keyboard-intervention", daemon=True)
        self._thread.start()
        if self.echo_help:
            sys.stderr.write("[intervention] i: take over/release  wasd rf: move  space: gripper  "
                             "y: success  n: failure  x: reset  q: quit\n")

    def _run(self) -> None:
        buf = b""
        while not self._halt.is_set():
            r, _, _ = select.select([self.fd], [], [], 0.05)
            if not r:
                continue
            try:
                data = os.read(self.fd, 64)
            except OSError:
                break
            if not data:
                break
            buf += data
            buf = self._consume(buf)

    def _consume(self, buf: bytes) -> bytes:
        now = time.monotonic()
        while buf:
            if buf.startswith(b"\x1b["):
                if len(buf) < 3:
                    return buf
                key = {b"A": "UP", b"B": "DOWN", b"C": "RIGHT", b"D": "LEFT"}.get(buf[2:3])
                buf = buf[3:]
            elif buf.startswith(b"\x1b") and len(buf) == 1:
                return buf
            else:
                key = buf[:1].decode("latin-1").lower()
                buf = buf[1:]
            if key is None:
                continue
            with self._lock:
                if key == "i":
                    self._takeover = not self._takeover
                    self._pressed.clear()
                elif key == " ":
                    self._gripper = -self._gripper
                elif key in _KEY_EVENTS:
                    self._events.add(_KEY_EVENTS[key])
                elif key in _KEY_AXES:
                    self._pressed[key] = now
        return buf

    def poll(self, step: int = 0, obs=None) -> InterventionState:
        now = time.monotonic()
        with self._lock:
            events, self._events = self._events, set()
            if not self._takeover:
                return InterventionState(False, None, events)
            a = np.zeros(GENERIC_DIM, np.float32)
            for key, t in list(self._pressed.items()):
                if now - t > self.hold_s:
                    del self._pressed[key]
                    continue
                axis, sign = _KEY_AXES[key]
                a[axis] += sign * self.speed
            a[6] = self._gripper
            return InterventionState(True, np.clip(a, -1, 1), events)

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._saved_attrs is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved_attrs)
            self._saved_attrs = None


# ---------------------------------------------------------------- gamepad (pygame / SDL)

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


# ---------------------------------------------------------------- SpaceMouse (hidapi)

SPACEMOUSE_VENDORS = (0x256F, 0x046D)   # 3Dconnexion, Logitech (older 3Dconnexion devices)


class SpaceMouseIntervention(InterventionSource):
    """A 3Dconnexion SpaceMouse read with ``hidapi`` (module ``hid``); see the module
    docstring. ``scale`` maps raw axis counts (about +-350) to [-1, 1]."""

    def __init__(self, *, deadzone: float = 0.08, scale: float = 350.0, path: bytes | None = None):
        self.deadzone = float(deadzone)
        self.scale = float(scale)
        self.path = path
        self._dev = None
        self._lock = threading.Lock()
        self._axes = np.zeros(6, np.float32)
        self._buttons = 0
        self._prev_buttons = 0
        self._gripper = -1.0
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import hid
        except ImportError as exc:
            raise DeviceUnavailable("SpaceMouse intervention needs hidapi (pip install hidapi) and "
                                    "the system library libhidapi-hidraw0") from exc
        path = self.path
        if path is None:
            for d in hid.enumerate():
                if d["vendor_id"] in SPACEMOUSE_VENDORS and "space" in (d.get("product_string") or "").lower():
                    path = d["path"]
                    break
        if path is None:
            raise DeviceUnavailable("no SpaceMouse found (3Dconnexion USB/receiver); check it is plugged "
                                    "in and /dev/hidraw* is readable by this user (udev rule)")
        self._dev = hid.device()
        self._dev.open_path(path)
        self._dev.set_nonblocking(True)
        self._thread = threading.Thread(target=self._run, name="spacemouse", daemon=True)
        self._thread.start()

    @staticmethod
    def _i16(lo: int, hi: int) -> int:
        v = lo | (hi << 8)
        return v - 65536 if v >= 32768 else v

    def _run(self) -> None:
        while not self._halt.is_set():
            data = self._dev.read(64)
            if not data:
                time.sleep(0.002)
                continue
            with self._lock:
                rid = data[0]
                if rid == 1 and len(data) >= 7:
                    self._axes[:3] = [self._i16(data[1], data[2]), self._i16(data[3], data[4]),
                                      self._i16(data[5], data[6])]
                    if len(data) >= 13:  # newer devices send rotation in the same report
                        self._axes[3:] = [self._i16(data[7], data[8]), self._i16(data[9], data[10]),
                                          self._i16(data[11], data[12])]
                elif rid == 2 and len(data) >= 7:
                    self._axes[3:] = [self._i16(data[1], data[2]), self._i16(data[3], data[4]),
                                      self._i16(data[5], data[6])]
                elif rid == 3 and len(data) >= 2:
                    self._buttons = data[1]

    def poll(self, step: int = 0, obs=None) -> InterventionState:
        with self._lock:
            raw = self._axes.copy()
            buttons, prev = self._buttons, self._prev_buttons
            self._prev_buttons = buttons
        events = set()
        pressed = buttons & ~prev
        if pressed & 1:
            self._gripper = -self._gripper
        if pressed & 2:
            events.add("success")
        v = np.clip(raw / self.scale, -1, 1)
        v[np.abs(v) < self.deadzone] = 0.0
        if not np.any(v):
            return InterventionState(False, None, events)
        # device frame (x right, y toward user, z down) -> robot base frame (x forward, y left, z up)
        a = np.array([-v[1], -v[0], -v[2], -v[4], -v[3], -v[5], self._gripper], np.float32)
        return InterventionState(True, a, events)

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._dev is not None:
            self._dev.close()
            self._dev = None


def make_source(kind: str, **kwargs) -> InterventionSource:
    """``keyboard``, ``gamepad``, ``spacemouse`` (started) or ``none``; raises
    DeviceUnavailable with a clear message when the device is missing."""
    kinds = {"keyboard": KeyboardIntervention, "gamepad": GamepadIntervention,
             "spacemouse": SpaceMouseIntervention}
    if kind not in kinds:
        raise ValueError(f"intervention device must be one of {', '.join(kinds)}, got {kind!r}")
    src = kinds[kind](**kwargs)
    src.start()
    return src


# ---------------------------------------------------------------- the wrapper

def default_action_map(action_dim: int) -> list[int]:
    if action_dim == GENERIC_DIM:
        return list(range(GENERIC_DIM))
    if action_dim == 4:
        return [0, 1, 2, 6]
    if action_dim == 3:
        return [0, 1, 2]
    raise ValueError(f"no default mapping from the 7-D device command to a {action_dim}-D action; "
                     "give action_map (indices into [dx, dy, dz, droll, dpitch, dyaw, gripper])")


class InterventionWrapper(gym.Wrapper):
    """Let a human take over the action and label episodes (see the module docstring).

    ``label_reward``: a ``success`` label gives reward 1.0 on that step.
    """

    def __init__(self, env: gym.Env, source: InterventionSource, *, action_map: Sequence[int] | None = None,
                 label_reward: bool = True):
        super().__init__(env)
        self.source = source
        dim = int(env.action_space.shape[0])
        self.action_map = list(action_map) if action_map is not None else None
        self._dim = dim
        self.label_reward = bool(label_reward)
        self._t = 0
        self._obs = None
        self.quit_requested = False

    def _to_env(self, state: InterventionState) -> np.ndarray:
        a = np.asarray(state.action, np.float32).reshape(-1)
        if not state.env_space:
            idx = self.action_map if self.action_map is not None else default_action_map(self._dim)
            a = a[idx]
        if a.shape != self.env.action_space.shape:
            raise ValueError(f"human action has shape {a.shape}, env wants {self.env.action_space.shape}")
        return np.clip(a, self.env.action_space.low, self.env.action_space.high).astype(np.float32)

    def reset(self, **kwargs):
        self._t = 0
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        info["intervened"] = False
        return obs, info

    def step(self, action):
        state = self.source.poll(self._t, self._obs)
        policy_action = np.asarray(action, np.float32)
        applied = self._to_env(state) if state.active and state.action is not None else policy_action
        obs, reward, terminated, truncated, info = self.env.step(applied)
        self._t += 1
        self._obs = obs
        intervened = bool(state.active and state.action is not None)
        info["intervened"] = intervened
        info["policy_action"] = policy_action
        if intervened:
            # what reached the robot: after a SafetyWrapper beneath, its safe version
            info["human_action"] = np.asarray(info.get("applied_action", applied), np.float32)
        if "success" in state.events:
            info["is_success"] = True
            info["human_label"] = "success"
            terminated = True
            if self.label_reward:
                reward = 1.0
        elif "failure" in state.events:
            info["is_success"] = False
            info["human_label"] = "failure"
            terminated = True
        if "reset" in state.events and not terminated:
            info["human_reset"] = True
            truncated = True
        if "quit" in state.events:
            info["quit"] = True
            self.quit_requested = True
            truncated = truncated or not terminated
        return obs, reward, bool(terminated), bool(truncated), info

    def close(self):
        try:
            self.source.close()
        finally:
            super().close()
