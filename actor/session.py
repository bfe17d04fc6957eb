"""The actor's session with the learner: its sockets and the handshake that opens them.

A :class:`Session` owns the main DEALER (``sock``) and the act DEALER (``act_sock``), says
``hello`` and reads the ``welcome``: whether a session is open (``connected``), which learner
holds it (``learner_id``), the learner's :class:`data.core.spec.EnvSpec`, whether it hands out
jobs and its mode. A late welcome restarts the handshake on a fresh socket ("lazy pirate");
the learner's refusal is final (:class:`HandshakeError`), as is an evaluation that is finished
(:class:`LearnerFinished`); ``actor_id_in_use`` (our previous session still holds the id) is
retried. What the welcome says about the transition stream (acked and received sequence
numbers, the next episode) is the client's to act on (:class:`actor.client.LearnerClient`),
as is every message once the session is open: the session only receives and decodes them,
noting when the learner was last heard (``last_rx``).

The act socket's routing id is the session's ``act_token``; it is rebuilt with every welcome,
and absent (acts use ``sock``) when the welcome names no ``act_port``.
"""

from __future__ import annotations

import logging
import time
import uuid

import zmq

from actor.spool import Spool
from data.core.codec import CodecError, Message, decode, encode, recv_frames
from data.core.schema import ACT_TOKEN_BYTES
from data.core.security import configure_client_socket
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.actor.session")
_RCVTIMEO = int(zmq.RCVTIMEO)  # a plain int: pyzmq's enum members cost Python-level enum code


class HandshakeError(RuntimeError):
    """The learner refused this actor (config mismatch, bad hello): not retried."""


class LearnerFinished(RuntimeError):
    """The learner said it is done (evaluation finished)."""


class Session:
    def __init__(self, *, ctx: zmq.Context, host: str, port: int, actor_id: str, config_hash: str,
                 spool: Spool, timeout_s: float, security: dict, max_message_bytes: int):
        self.ctx, self.host = ctx, host
        self.endpoint = f"tcp://{host}:{port}"
        self.actor_id, self.config_hash = actor_id, config_hash
        self.spool = spool  # read for the hello's resend_from only
        self.timeout_s = timeout_s
        self.security, self.max_message_bytes = security, max_message_bytes
        self.sock: zmq.Socket | None = None
        #: the act socket (routing id = the session's act token), None: acts use ``sock``
        self.act_sock: zmq.Socket | None = None
        self.connected = False
        self.learner_id: str | None = None
        self.mode = "train"
        #: the learner's spec from the last welcome (env layout + policy extras), or None
        self.spec: EnvSpec | None = None
        #: the learner hands out jobs
        self.jobs = False
        self.reconnects = 0
        self.last_rx = 0.0  # when anything last arrived from the learner
        self._hello_at = 0.0
        self._hello_attempts = 0
        self._in_use_warned = False
        #: random per-process token in every hello: the learner lets this process take over its
        #: own live session (a retried handshake), never another process claiming the same id
        self.instance = uuid.uuid4().hex

    def _dealer(self, endpoint: str, options: dict[int, int | bytes] | None = None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # per frame, before it is buffered
        for option, value in (options or {}).items():
            s.setsockopt(option, value)
        configure_client_socket(s, self.security)
        s.connect(endpoint)
        return s

    def start(self) -> None:
        """A fresh main socket and a hello on it; the session is closed until the welcome."""
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self._dealer(self.endpoint)
        self.connected = False
        self._hello_at = time.monotonic()
        self._hello_attempts += 1
        self.sock.send_multipart(encode("hello", {
            "actor_id": self.actor_id, "config_hash": self.config_hash,
            "resend_from": self.spool.resend_from, "instance": self.instance,
        }))
        if self._hello_attempts == 2 or self._hello_attempts % 10 == 0:
            log.warning("no answer from learner at %s (attempt %d); retrying", self.endpoint,
                        self._hello_attempts - 1)

    def pump(self, timeout_s: float) -> Message | None:
        """Wait up to ``timeout_s`` for the welcome and return it (for the client to
        :meth:`accept`), else None; restart the handshake when it is late."""
        if self.sock is None:
            self.start()
        if self.sock.poll(int(timeout_s * 1000)):
            msg = self.recv()
            if msg is not None and msg.type == "welcome":
                return msg
            if msg is not None and msg.type == "error":
                if msg["code"] == "finished":
                    raise LearnerFinished(msg["message"])
                if msg["code"] == "actor_id_in_use":
                    # our previous session (or an impostor) still holds the id: the learner
                    # frees it once that session is silent; the hello is retried after timeout_s
                    if not self._in_use_warned:
                        log.warning("learner: %s (retrying)", msg["message"])
                        self._in_use_warned = True
                    return None
                raise HandshakeError(f"learner refused actor {self.actor_id!r}: {msg['code']}: {msg['message']}")
        elif time.monotonic() - self._hello_at > self.timeout_s:
            self.start()
        return None

    def accept(self, msg: Message) -> None:
        """Open the session a welcome describes (its learner, spec, jobs, mode, act socket)."""
        if self.learner_id is not None and msg["learner_id"] != self.learner_id:
            log.info("learner restarted (%s -> %s)", self.learner_id, msg["learner_id"])
        self.reconnects += int(self.learner_id is not None)
        try:
            spec = EnvSpec.from_dict(msg["spec"])
        except ValueError as exc:
            raise HandshakeError(f"learner sent a bad spec: {exc}") from None
        self.learner_id = msg["learner_id"]
        self.spec = spec
        self.jobs = bool(msg["jobs"])
        self.mode = msg["mode"]
        self.connected = True
        self._hello_attempts = 0
        self._in_use_warned = False
        self.last_rx = time.monotonic()
        self._open_act_socket(msg["act_port"], msg["act_token"])

    def _open_act_socket(self, port: int, token: bytes) -> None:
        """A fresh act DEALER for this session (the old one belonged to the last session)."""
        if self.act_sock is not None:
            self.act_sock.close(0)
            self.act_sock = None
        if port == 0:
            return
        if len(token) != ACT_TOKEN_BYTES or token[0] == 0:
            raise HandshakeError(f"learner sent a bad act_token ({len(token)} bytes; expected "
                                 f"{ACT_TOKEN_BYTES}, not starting with 0)")
        # the receive timeout is act()'s first wait; observations up to copy_threshold are
        # copied on send: cheaper than a zero-copy frame's hand-back through pyzmq's
        # garbage-collector thread
        s = self._dealer(f"tcp://{self.host}:{port}", {
            zmq.ROUTING_ID: token, _RCVTIMEO: max(1, int(self.timeout_s * 1000))})
        s.copy_threshold = 1 << 20
        self.act_sock = s

    def close(self) -> None:
        if self.act_sock is not None:
            self.act_sock.close(0)
            self.act_sock = None
        if self.sock is not None:
            try:
                if self.connected:
                    self.sock.send_multipart(encode("bye"), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.sock.close(0)
            self.sock = None

    def recv(self, sock: zmq.Socket | None = None) -> Message | None:
        """The next message on ``sock`` (the main socket by default), None if it is malformed."""
        sock = sock or self.sock
        return self.decode(recv_frames(sock, copy=sock is not self.act_sock))

    def decode(self, frames: list) -> Message | None:
        self.last_rx = time.monotonic()
        try:
            return decode(frames, max_bytes=self.max_message_bytes)
        except CodecError as exc:
            log.error("bad message from learner: %s", exc)
            return None
