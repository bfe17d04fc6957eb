"""The wire gate: a server's network-facing ZMQ sockets live in a process of their own.

Two things libzmq (4.3.5, the version in ``uv.lock``; its master branch is the same) cannot be
told not to do, both triggered by any peer that reaches a port, no keys needed without CURVE:

- **abort the process.** A ROUTER names a peer that sets no routing id ``\\0`` + a 32-bit
  counter; a peer may set its own id to any bytes, that form included, and libzmq never
  checks. When the counter reaches an id a peer already holds, the insert in
  ``routing_socket_base_t::add_out_pipe`` fails a ``zmq_assert`` (``socket_base.cpp``) and the
  process aborts. The counter starts at ``rand()``, and libzmq never seeds it: the first
  ROUTER of every process starts at 0x6b8b4567, so one crafted connection before an ordinary
  one is enough. ZAP sees only the server's own routing id, ``ROUTER_HANDOVER`` does not cover
  generated ids (and renames into the same insert), and there is no option to refuse ids.
- **buffer without bound.** ``ZMQ_MAXMSGSIZE`` limits one frame; nothing limits the frames of
  a message, and a message is buffered whole before the socket's owner sees any of it.

So the server (the learner; the robot driver) binds nothing on the network: :class:`Gate`
starts ``python -m data.core.gate_main`` (what it does: that module), which binds the ports
(CURVE and ZAP included), enforces the per-frame limit in libzmq and the per-message limits
(frames, bytes) before relaying, caps its own memory, and relays over ipc sockets in a
private folder. The server binds the :attr:`Gate.backends` (a DEALER per ``router`` front,
messages ``[routing id, (CURVE User-Id,) frames...]`` in and ``[routing id, frames...]``
out; a PUB per ``pub`` front). A gate that dies is started again by :meth:`Gate.poll` on the
same ports (counted in :attr:`Gate.restarts`, its exit in :attr:`Gate.exits`): peers
reconnect by themselves, the server keeps its state.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("tandem.data.core.gate")

#: the frames a message may have at most (a header and 4096 arrays: the codec's limit)
DEFAULT_MAX_FRAMES = 4097


@dataclass
class Front:
    """One network-facing socket of the gate."""

    name: str
    #: "router": requests and replies (a ROUTER here, a DEALER at the server); "pub": broadcasts
    kind: str = "router"
    host: str = "127.0.0.1"
    port: int = 0
    #: when ``port`` is taken, bind one the OS picks (the server says which to its peers)
    fallback: bool = False
    #: the largest frame (ZMQ_MAXMSGSIZE: a larger one disconnects its peer unbuffered)
    max_frame_bytes: int = 64 << 20
    #: the largest message, all frames together, and its most frames ("router" only)
    max_message_bytes: int = 64 << 20
    max_frames: int = DEFAULT_MAX_FRAMES
    #: frames sent back for a message over those limits (the server's own error message)
    too_large_reply: list[bytes] = field(default_factory=list)


class GateError(RuntimeError):
    """The gate could not start (a port taken, a bad key, ...): the message says why."""


class Gate:
    def __init__(self, fronts: list[Front], security: dict | None = None, *,
                 memory_bytes: int = 4 << 30, start_timeout_s: float = 60.0):
        self.fronts = list(fronts)
        self.security = dict(security or {})
        self.memory_bytes = int(memory_bytes)
        self.start_timeout_s = float(start_timeout_s)
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-gate-"))  # 0700: this user's only
        #: front name -> the ipc endpoint the server binds before :meth:`start`
        self.backends = {f.name: f"ipc://{self.dir}/{f.name}" for f in self.fronts}
        #: front name -> the TCP port it is bound to (after :meth:`start`)
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.exits: list[int] = []  # return codes of gates that died (-6: SIGABRT)
        self.stats: dict[str, int] = {}
        self._stats_base: dict[str, int] = {}  # counters of the gates before this one
        self._buf = b""
        self._retry_at = 0.0
        self._fails = 0
        self._noted = False

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> dict[str, int]:
        """Start the gate process and wait until its sockets are bound; returns the ports.
        Raises GateError naming what failed."""
        cfg = {"fronts": [dict(asdict(f), backend=self.backends[f.name],
                               port=self.ports.get(f.name, f.port),
                               fallback=f.fallback and f.name not in self.ports,
                               too_large_reply=[bytes(b).hex() for b in f.too_large_reply])
                          for f in self.fronts],
               "security": self.security, "memory_bytes": self.memory_bytes}
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self._buf = b""
        self._noted = False
        # its own session: a signal to the server's process group (kill -- -PGID, a terminal's
        # Ctrl-C) stops the server, which stops the gate; the gate ends by itself when its parent
        # is gone (gate_main), so a killed server leaves no gate behind
        self.proc = subprocess.Popen([sys.executable, "-m", "data.core.gate_main"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=root, start_new_session=True)
        self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
        self.proc.stdin.close()
        line = self._read_line(self.start_timeout_s)
        msg = json.loads(line) if line else {}
        if "ports" not in msg:
            self._reap()
            raise GateError(msg.get("error") or f"the wire gate did not start within "
                            f"{self.start_timeout_s:.0f}s (exit {self.proc.returncode})")
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.ports = {k: int(v) for k, v in msg["ports"].items()}
        # a gate whose owner forgets it (never started, dropped) ends with it, at the latest
        # when this interpreter exits
        weakref.finalize(self, _terminate, self.proc, self.dir)
        return dict(self.ports)

    def _read_line(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return b""
            chunk = os.read(fd, 65536)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> bool:
        """Read the gate's counters; when it has died, log why and start a new one on the same
        ports (after a short backoff if it keeps dying). Returns True when it restarted one."""
        if self.proc is None:
            return False
        self._read_stats()
        if self.proc.poll() is None:
            return False
        if not self._noted:
            self._noted = True
            code = self.proc.returncode
            self.exits.append(code)
            self._stats_base = dict(self.stats)
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            log.error("the wire gate died (%s%s); starting a new one on ports %s (peers reconnect)",
                      why, ": libzmq aborted (a peer's crafted routing id?) or its memory cap was "
                      "reached" if code == -signal.SIGABRT else "", self.ports)
        now = time.monotonic()
        if now < self._retry_at:
            return False
        try:
            self.start()
        except (GateError, OSError) as exc:
            self._fails += 1
            self._retry_at = now + min(5.0, 0.1 * 2 ** self._fails)
            log.error("the wire gate could not start again (%s); retrying", exc)
            return False
        self._fails, self._retry_at = 0, 0.0
        self.restarts += 1
        return True

    def _read_stats(self) -> None:
        try:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
        except (BlockingIOError, OSError, ValueError):
            chunk = b""
        if chunk:
            self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                stats = json.loads(line).get("stats")
            except ValueError:
                continue
            if isinstance(stats, dict):
                self.stats = {k: self._stats_base.get(k, 0) + int(v) for k, v in stats.items()}

    def stop(self) -> None:
        """Stop the gate process and remove its folder."""
        self._reap()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _reap(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _terminate(proc: subprocess.Popen, folder: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
    shutil.rmtree(folder, ignore_errors=True)
