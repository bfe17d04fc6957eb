"""Keyboard intervention from a terminal in raw (cbreak) mode: no display and no
``pynput`` needed. ``i`` toggles takeover; while taking over, ``w/s`` x, ``a/d`` y, ``r/f``
z, ``j/l`` yaw, ``u/o`` roll, ``k/m`` pitch (or the arrow keys for x/y); ``space`` toggles
the gripper. Hotkeys: ``y`` success, ``n`` failure, ``x`` reset, ``q`` quit."""

from __future__ import annotations

import os
import select
import sys
import threading
import time

import numpy as np

from envs.intervention.base import GENERIC_DIM, DeviceUnavailable, InterventionSource, InterventionState

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
