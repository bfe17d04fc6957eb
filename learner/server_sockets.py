"""The learner's sockets behind the wire gate (:mod:`data.core.gate`: why the network-facing
sockets live in a process of their own, and what it enforces).

:func:`open_server_sockets` checks the bind policy, binds the learner's private ends (a DEALER
for the main socket and one for the act socket, a PUB for weight broadcasts) and starts the
gate, which binds ``host:port``, ``act_port`` and ``pub_port``. Messages from actors arrive
as ``[routing id, (CURVE User-Id,) frames...]`` (the User-Id frame only with CURVE keys), as
a ROUTER's would with the key read off the frame; replies go out as ``[routing id, frames...]``.
A reply the gate cannot take now (no gate: it is restarting; or its queue is full) is dropped
(:func:`send_or_drop`): the actor retries, as it does for a lost reply. :class:`Outboxes` are
the other threads' ways into the socket thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from data.core.codec import encode, send_frames
from data.core.gate import DEFAULT_MAX_FRAMES, Front, Gate, GateError
from data.core.security import check_bind_policy


@dataclass
class ServerSockets:
    gate: Gate
    main: zmq.Socket
    pub: zmq.Socket
    act: zmq.Socket | None
    port: int
    pub_port: int
    act_port: int

    def close(self) -> None:
        for s in (self.main, self.pub, self.act):
            if s is not None:
                s.close(0)
        self.gate.stop()


def open_server_sockets(ctx: zmq.Context, *, host: str, port: int, pub_port: int,
                        act_port: int | None, act_socket: bool, security: dict,
                        max_message_bytes: int, memory_bytes: int) -> ServerSockets:
    """Bind the learner's private ends and start the gate on the public ports. ``act_port``
    None: ``port + 2``, or one the OS picks when that is taken (or ``port`` is 0). Raises
    ValueError (a bind the security settings refuse) or zmq.ZMQError (a port taken: the
    gate's message names it)."""
    check_bind_policy(host, security)
    too_large = encode("error", {"code": "message_too_large", "message": (
        f"a message over {max_message_bytes} bytes or {DEFAULT_MAX_FRAMES} frames; nothing of it "
        "was read")})
    router = dict(host=host, max_frame_bytes=max_message_bytes, max_message_bytes=max_message_bytes,
                  too_large_reply=[bytes(memoryview(f)) for f in too_large])
    fronts = [Front("main", port=port, **router),
              Front("pub", kind="pub", host=host, port=pub_port, max_frame_bytes=4096)]
    if act_socket:
        fronts.append(Front("act", port=(port + 2 if port else 0) if act_port is None else act_port,
                            fallback=act_port is None, **router))
    gate = Gate(fronts, security, memory_bytes=memory_bytes)
    main = _back(ctx, zmq.DEALER, gate.backends["main"])
    pub = _back(ctx, zmq.PUB, gate.backends["pub"])
    pub.setsockopt(zmq.SNDHWM, 4)
    act = _back(ctx, zmq.DEALER, gate.backends["act"]) if act_socket else None
    try:
        ports = gate.start()
    except GateError as exc:
        for s in (main, pub, act):
            if s is not None:
                s.close(0)
        gate.stop()
        raise zmq.ZMQError(zmq.EADDRINUSE if "bind" in str(exc) else zmq.EFAULT,
                           f"the learner's wire gate did not start: {exc}") from None
    return ServerSockets(gate, main, pub, act, ports["main"], ports["pub"], ports.get("act", 0))


def _back(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.DEALER:
        s.setsockopt(zmq.SNDTIMEO, 0)  # never block: a reply the gate cannot take is dropped
        s.setsockopt(zmq.RCVHWM, 64)
    s.bind(endpoint)
    return s


def send_or_drop(sock: zmq.Socket, frames: list) -> bool:
    """Send ``frames`` to the gate; False (dropped) when it cannot take them now."""
    try:
        send_frames(sock, frames)
        return True
    except zmq.Again:
        return False


@dataclass
class _Outbox:
    sock: zmq.Socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class Outboxes:
    """Each thread's PUSH socket into the learner's socket thread (an inproc PULL at ``addr``),
    made on the thread's first send. A send waits at most 2 s (a socket thread that is gone
    must not block its caller) and holds the socket's lock, so :meth:`close_all` (the socket
    thread, as it ends) never closes one while its thread is inside a send (libzmq aborts);
    a closed one drops what it is given."""

    def __init__(self, ctx: zmq.Context, addr: str):
        self.ctx, self.addr = ctx, addr
        self._local = threading.local()
        self._all: list[_Outbox] = []
        self._lock = threading.Lock()

    def get(self) -> _Outbox:
        box = getattr(self._local, "box", None)
        if box is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(self.addr)
            box = self._local.box = _Outbox(sock)
            with self._lock:
                self._all.append(box)
        return box

    def push(self, frames: list) -> bool:
        """Send ``frames`` from this thread; False (dropped) when the socket thread cannot take it."""
        box = self.get()
        with box.lock:
            if box.closed:
                return False
            try:
                box.sock.send_multipart(frames, copy=False)
                return True
            except zmq.Again:
                return False

    def close_all(self) -> None:
        with self._lock:
            for box in self._all:
                with box.lock:
                    box.sock.close(0)
                    box.closed = True
