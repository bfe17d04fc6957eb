"""The act socket: a ROUTER of its own for ``act`` requests, read and answered by the
inference thread.

Through the socket thread an act request takes two thread hand-offs (ROUTER -> socket thread
-> queue -> inference thread -> outbox -> socket thread -> ROUTER), each one a wake-up of a
sleeping thread, which on a busy host costs more than the whole raw ZMQ round trip. On this
socket the inference thread polls for requests itself, decodes and validates each one
through the same :class:`learner.act_intake.ActIntake` as the socket thread, serves the batch
and sends the replies. The main ROUTER keeps the handshake,
ingest, heartbeats, weights and jobs, and a forward pass never blocks it: inference still
never runs on the socket thread. While a forward runs, new requests wait in this socket's
queue, as they waited in the inference queue before.

Sessions: the ``welcome`` hands each actor an ``act_token`` (:data:`ACT_TOKEN_BYTES` random
bytes) and the ``act_port``; the actor's act DEALER uses the token as its ZMQ routing id, so
a request's identity frame names its session. A request from an unknown token (no
handshake, a forgotten session, a restarted learner) gets ``handshake_required``; with CURVE
keys the request's key must also be that session's actor's key. Every other rejection is the
main socket's: an ``error`` reply naming what is wrong, counted in the service's
``counters``/``rejections``, and the loop keeps serving.

The socket is the learner's end of the act port, whose network side is the wire gate's
(:mod:`learner.server_sockets`); :class:`learner.service.LearnerService` creates it (bind
errors surface in the caller's thread) and it is handed to one
:class:`learner.inference.InferenceServer` (``claim``); only that server's thread touches it
afterwards. The service advertises the
port only once a server has claimed it, so a learner without one keeps acts on the main
socket.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from data.core.codec import encode, recv_frames
from data.core.schema import ACT_TOKEN_BYTES
from learner.wire_guard import RateLimitedLog

log = logging.getLogger("tandem.learner.act")


def is_act_token(identity: bytes) -> bool:
    """Whether a routing id has the shape of an act token (ZMQ's own ids start with 0)."""
    return len(identity) == ACT_TOKEN_BYTES and identity[0] != 0


_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints
_SNDMORE = int(zmq.SNDMORE)


def drain(sock: zmq.Socket, limit: int = 256, *, ready: bool = False):
    """Up to ``limit`` waiting messages, without blocking (so neither socket starves). Asks
    the socket whether a message is waiting rather than catching ``zmq.Again``: raising
    that costs more than the rest of a small request's receive. ``ready``: a poll has just
    said a message is waiting (the first receive needs no question)."""
    for i in range(limit):
        if not (ready and i == 0) and not sock.getsockopt(_EVENTS) & _POLLIN:
            return
        try:
            yield recv_frames(sock, _NOBLOCK, copy=False)
        except zmq.Again:
            return


class ActChannel:
    def __init__(self, service: Any, sock: zmq.Socket, port: int):
        """``service``: the :class:`learner.service.LearnerService` (not imported: it imports
        this module); ``sock``: the learner's end of the act socket (messages ``[routing id, (CURVE
        User-Id,) frames...]`` from the wire gate, :mod:`learner.server_sockets`); ``port``:
        the act socket's TCP port, bound by the gate."""
        self.service = service
        self.sock = sock
        self.port = int(port)
        self._skip = 2 if service._curve else 1
        self._warn = RateLimitedLog(log)
        self._lock = threading.Lock()
        self.claimed = False
        self.closed = False
        self.owner: int | None = None  # thread id of the claiming server's running thread

    # ---- ownership ------------------------------------------------------------------------

    def claim(self) -> None:
        """Hand the socket to the (one) inference server; raises if already claimed/closed."""
        with self._lock:
            if self.claimed or self.closed:
                raise RuntimeError("this act socket is already claimed by an inference server "
                                   "or closed")
            self.claimed = True

    def attach_thread(self) -> bool:
        """Called once by the claiming server's thread: from now on only it uses the socket.
        False when the socket was closed meanwhile."""
        with self._lock:
            if self.closed:
                return False
            self.owner = threading.get_ident()
            return True

    def owns_thread(self) -> bool:
        return self.owner == threading.get_ident()

    def close(self, *, unless_owned: bool = False) -> None:
        """Close the socket (``unless_owned``: only when no server thread has taken it; that
        thread closes it when it ends)."""
        with self._lock:
            if self.closed or (unless_owned and self.owner is not None):
                return
            self.closed = True
        self.sock.close(0)

    # ---- the inference thread's side ------------------------------------------------------

    def read(self, *, ready: bool = False, limit: int = 256) -> int:
        """Decode and validate up to ``limit`` waiting requests, without blocking; valid ones
        go to the service's ``submit_act`` (the inference server's queue), bad ones get their
        error reply. ``ready``: a poll has just said one is waiting. Returns how many messages
        were read. (The inference server passes as ``limit`` the requests it still waits for:
        one actor's request is read without asking the socket whether another one waits;
        any others stay queued for the next poll.)"""
        sock, n = self.sock, 0
        limit = min(limit, 256)
        while n < limit:  # (drain's loop, inline: this is the act path)
            if (n or not ready) and not sock.getsockopt(_EVENTS) & _POLLIN:
                break
            try:
                frames = recv_frames(sock, _NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            identity = frames[0].bytes
            try:
                self._handle(identity, frames)
            except Exception as exc:  # the same promise as the socket thread: serve on
                self.service.count_rejection("internal_error", internal=True)
                self._warn.warning("act message raised %s (counted, serving on)",
                                   type(exc).__name__, exc_info=exc)
                try:
                    self.send(identity, encode("error", {
                        "code": "internal_error",
                        "message": f"the learner could not process this message: "
                                   f"{type(exc).__name__}: {str(exc)[:200]}"}))
                except Exception:
                    pass
        return n

    def send(self, identity: bytes, frames: list) -> None:
        last = len(frames) - 1
        if last < 0:
            raise ValueError("a message needs at least one frame")
        send = self.sock.send
        try:
            send(identity, _SNDMORE)  # (copied: the routing id is a few bytes)
        except zmq.Again:  # the gate cannot take it now (restarting): the actor retries
            self.service.counters["dropped_replies"] += 1
            return
        for i in range(last):
            send(frames[i], _SNDMORE, copy=False)
        send(frames[last], 0, copy=False)

    def _error(self, identity: bytes, code: str, message: str, who: str = "") -> None:
        self.service.count_rejection(code)
        self._warn.warning("rejected act message from %s: %s: %s", who or identity.hex(), code,
                           message[:500])
        self.send(identity, encode("error", {"code": code, "message": message}))

    def _handle(self, identity: bytes, frames: list) -> None:
        """One message: ``frames[0]`` is the routing id (``identity``), the rest the message."""
        svc = self.service
        key = frames[1].bytes.decode("ascii", "replace") if self._skip == 2 else None
        del frames[:self._skip]
        peer = svc.act_sessions.get(identity) if frames else None
        if peer is None:
            self._error(identity, "handshake_required",
                        "unknown act session: send hello on the learner's main socket and use "
                        "the act_token of its welcome as this socket's routing id")
            return
        if svc.key_ids is not None and svc.key_ids.get(key or "") != peer.actor_id:
            self._error(identity, "identity_mismatch",
                        f"this CURVE key is not actor {peer.actor_id!r}'s", peer.actor_id)
            return
        req = svc.act_intake.read(identity, frames, peer.actor_id, touch=peer)
        if type(req) is tuple:
            code, message = req
            if code == "finished":
                self.send(identity, encode("error", {"code": code, "message": message}))
            else:
                self._error(identity, code, message, peer.actor_id)
            return
        svc.submit_act(req)
