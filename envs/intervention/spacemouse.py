"""3Dconnexion SpaceMouse intervention through ``hidapi`` (module ``hid``). Moving the
cap beyond the dead zone takes over; the left button toggles the gripper; the right button
labels success."""

from __future__ import annotations

import threading
import time

import numpy as np

from envs.intervention.base import DeviceUnavailable, InterventionSource, InterventionState

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
