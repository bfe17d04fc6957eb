"""The actor's connection to the learner: a DEALER socket (and an act DEALER), used from one
thread.

It handshakes, asks for actions, streams spooled transition batches and processes acks,
with timeouts, retries and heartbeats. When the learner stops answering (restart, dropped
link) it closes the socket, opens a new one and handshakes again ("lazy pirate"); the
welcome says what the learner has acknowledged, and everything after that is resent from
the spool. A config mismatch or an evaluation that is finished is final and raised; an act
that gets no actions (the learner could not serve it, or did not answer) raises
:class:`ActError`, never final: the loop holds its env and asks again. A batch the learner
refuses (``batch_rejected``) becomes a dead letter in the spool (:meth:`actor.spool.Spool.dead_letter`).

Acts go to the learner's act socket when the welcome names one (``act_port``, served by its
inference thread: :mod:`learner.act_channel`): a second DEALER whose routing id is the
session's ``act_token``, rebuilt with every welcome. A learner that forgot the session answers
``handshake_required`` there, and the client handshakes again and resends. Without an ``act_port``
acts use the main socket (a reply :meth:`poll` reads goes to ``on_act_reply``: :mod:`actor.rtc`).

The welcome carries the learner's :class:`data.core.spec.EnvSpec` (:attr:`LearnerClient.spec`:
the env layout plus the policy extras every record must carry) and whether the learner hands
out jobs (:attr:`LearnerClient.jobs`, then :meth:`LearnerClient.get_job` before each reset).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
import zmq

from actor.spool import Spool
from data.core.codec import CodecError, Message, decode, encode, recv_frames, send_frames
from data.core.jobs import Job
from data.core.schema import ACT_TOKEN_BYTES, EXTRA_PREFIX
from data.core.security import configure_client_socket
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.actor.client")
# plain ints: pyzmq's enum members cost Python-level enum code in & and in setsockopt
_POLLIN, _RCVTIMEO = int(zmq.POLLIN), int(zmq.RCVTIMEO)


class HandshakeError(RuntimeError):
    """The learner refused this actor (config mismatch, bad hello): not retried."""


class LearnerFinished(RuntimeError):
    """The learner said it is done (evaluation finished)."""


class ActError(RuntimeError):
    """No actions for this request: the learner could not serve it (``inference_failed``, ``bad_observation``),
    sent an unusable reply (``bad_reply``) or did not answer in time (``no_reply``, ``not_connected``).
    Never final: the actor holds its env safe and retries (:class:`actor.loop.ActorLoop`)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class LearnerClient:
    def __init__(
        self,
        *,
        ctx: zmq.Context,
        host: str,
        port: int,
        actor_id: str,
        config_hash: str,
        spool: Spool,
        timeout_s: float = 2.0,
        heartbeat_s: float = 1.0,
        reconnect_after: int = 3,
        max_in_flight: int = 16,
        security: dict | None = None,
        max_message_bytes: int = 64 << 20,
    ):
        self.ctx = ctx
        self.host = host
        self.endpoint = f"tcp://{host}:{port}"
        self.actor_id = actor_id
        self.config_hash = config_hash
        self.spool = spool
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_after = reconnect_after
        self.max_in_flight = max_in_flight
        self.security = security or {}
        self.max_message_bytes = max_message_bytes
        self.sock: zmq.Socket | None = None
        #: the act socket (routing id = the session's act token), None: acts use ``sock``
        self.act_sock: zmq.Socket | None = None
        self.learner_id: str | None = None
        self.mode = "train"
        #: the learner's spec from the last welcome (env layout + policy extras), or None
        self.spec: EnvSpec | None = None
        #: the learner hands out jobs (ask with :meth:`get_job` before each reset)
        self.jobs = False
        self._job_warned = False
        self._job_misses = 0
        self.policy_version = 0
        self.connected = False
        self.reconnects = 0
        self._req_id = 0
        self._in_flight: list[tuple[int, int]] = []  # sent, not yet received by the learner
        self._next_send = 0  # first sequence number not yet sent on this connection
        self._received = -1  # the learner has every record <= this
        self._last_rx = 0.0
        self._last_ping = 0.0
        self._last_progress = 0.0
        self.weights_msg: Message | None = None
        self._hello_at = 0.0
        self._hello_attempts = 0
        self._in_use_warned = False
        #: random per-process token in every hello: the learner lets this process take over its
        #: own live session (a retried handshake), never another process claiming the same id
        self.instance = uuid.uuid4().hex
        self.last_act_ms, self.on_act_reply = 0.0, None

    # ---- connection ----------------------------------------------------------------------

    def _new_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # per frame, before it is buffered
        configure_client_socket(s, self.security)
        s.connect(self.endpoint)
        self.sock = s

    def _start_handshake(self) -> None:
        self._new_socket()
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

    def _pump_handshake(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the welcome; restart the handshake when it is late."""
        if self.sock is None:
            self._start_handshake()
        if self.sock.poll(int(timeout_s * 1000)):
            msg = self._recv()
            if msg is not None and msg.type == "welcome":
                self._on_welcome(msg)
            elif msg is not None and msg.type == "error":
                if msg["code"] == "finished":
                    raise LearnerFinished(msg["message"])
                if msg["code"] == "actor_id_in_use":
                    # our previous session (or an impostor) still holds the id: the learner
                    # frees it once that session is silent; the hello is retried after timeout_s
                    if not self._in_use_warned:
                        log.warning("learner: %s (retrying)", msg["message"])
                        self._in_use_warned = True
                    return
                raise HandshakeError(f"learner refused actor {self.actor_id!r}: {msg['code']}: {msg['message']}")
        elif time.monotonic() - self._hello_at > self.timeout_s:
            self._start_handshake()

    def connect(self, *, give_up_after_s: float | None = None) -> None:
        """Handshake, retrying until the learner answers (or ``give_up_after_s`` passes)."""
        start = time.monotonic()
        self._start_handshake()
        while not self.connected:
            self._pump_handshake(min(0.2, self.timeout_s))
            if give_up_after_s is not None and time.monotonic() - start > give_up_after_s:
                raise TimeoutError(f"no learner answered at {self.endpoint} in {give_up_after_s:.0f}s")

    def _on_welcome(self, msg: Message) -> None:
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
        self.policy_version = msg["policy_version"]
        acked = msg["acked_seq"]
        if acked >= self.spool.next_seq:
            # the spool was lost but the learner has our records: continue after them
            self.spool.next_seq = acked + 1
        self.spool.ack(acked)
        self._received = msg["received_seq"]
        self._next_send = self._received + 1
        if msg["next_episode"] > self.spool.next_episode:
            self.spool.set_next_episode(msg["next_episode"])
        self._in_flight = []
        self.connected = True
        self._hello_attempts = 0
        self._in_use_warned = False
        now = time.monotonic()
        self._last_rx = self._last_ping = self._last_progress = now
        log.info("connected to learner %s at %s: acked seq %d, %d records to resend, version %d, "
                 "mode %s, extras %s, jobs %s", self.learner_id, self.endpoint, acked, len(self.spool),
                 self.policy_version, self.mode, sorted(spec.extras), self.jobs)
        self._open_act_socket(msg["act_port"], msg["act_token"])
        self.flush()

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
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, token)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # observations up to this size are copied on send: cheaper than a zero-copy frame's
        # hand-back through pyzmq's garbage-collector thread
        s.copy_threshold = 1 << 20
        s.setsockopt(_RCVTIMEO, max(1, int(self.timeout_s * 1000)))  # act()'s first wait
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        configure_client_socket(s, self.security)
        s.connect(f"tcp://{self.host}:{port}")
        self.act_sock = s

    def reconnect(self, *, block: bool = True) -> None:
        log.warning("learner at %s silent; reconnecting", self.endpoint)
        if block:
            self.connect()
        else:
            self._start_handshake()

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

    # ---- receiving -----------------------------------------------------------------------

    def _recv(self, sock: zmq.Socket | None = None) -> Message | None:
        sock = sock or self.sock
        return self._decode(recv_frames(sock, copy=sock is not self.act_sock))

    def _decode(self, frames: list) -> Message | None:
        self._last_rx = time.monotonic()
        try:
            return decode(frames, max_bytes=self.max_message_bytes)
        except CodecError as exc:
            log.error("bad message from learner: %s", exc)
            return None

    def _dispatch(self, msg: Message) -> None:
        if self.on_act_reply is not None and (msg.type == "act_reply" or msg.type == "error" and msg["code"] in (
                "bad_observation", "inference_failed", "bad_request")):
            self.on_act_reply(msg)
        elif msg.type == "welcome":
            self._on_welcome(msg)
        elif msg.type == "ack":
            self._on_ack(msg["acked_seq"], msg["received_seq"])
            self.policy_version = max(self.policy_version, msg["policy_version"])
        elif msg.type == "pong":
            self.policy_version = max(self.policy_version, msg["policy_version"])
        elif msg.type == "weights":
            self.weights_msg = msg
        elif msg.type == "batch_rejected":  # consumed by the learner: the ack that follows covers it
            self.spool.dead_letter(msg["first_seq"], msg["last_seq"], msg["code"], msg["message"])
        elif msg.type == "error":
            code = msg["code"]
            if code == "finished":
                raise LearnerFinished(msg["message"])
            if code == "handshake_required":
                self._start_handshake()
            elif code == "bad_transitions" and "sequence gap" in msg["message"]:
                self._resend()
            else:
                log.error("learner error %s: %s", code, msg["message"])

    def _on_ack(self, acked: int, received: int) -> None:
        self.spool.ack(acked)
        if received > self._received:
            self._received = received
            self._last_progress = time.monotonic()
            self._in_flight = [k for k in self._in_flight if k[1] > received]

    def _resend(self) -> None:
        """Send again everything after what the learner has received."""
        self._in_flight = []
        self._next_send = self._received + 1
        self._last_progress = time.monotonic()

    def poll(self, timeout_s: float = 0.0) -> None:
        """Process whatever the learner sent, heartbeat, resend and reconnect as needed.
        Never blocks longer than ``timeout_s``: while the learner is away the actor keeps
        stepping (local mode) and spooling, and the handshake is retried in the background."""
        if self.sock is None or not self.connected:
            self._pump_handshake(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            # without a timeout, ask the socket (Socket.poll builds a Poller per call)
            if (self.sock.getsockopt(zmq.EVENTS) & _POLLIN if remaining <= 0.0
                    else self.sock.poll(int(remaining * 1000))):
                msg = self._recv()
                if msg is not None:
                    self._dispatch(msg)
                continue
            break
        now = time.monotonic()
        if self._in_flight and now - self._last_progress > self.timeout_s:
            self._resend()  # nothing arrived for a while: resend what is pending
        if now - self._last_rx > self.heartbeat_s and now - self._last_ping > self.heartbeat_s:
            self.sock.send_multipart(encode("ping", {"t": time.time()}))
            self._last_ping = now
        if now - self._last_rx > self.heartbeat_s * self.reconnect_after + self.timeout_s:
            self.reconnect(block=False)
            return
        self.flush()

    # ---- requests ------------------------------------------------------------------------

    def flush(self) -> None:
        """Send spooled batches not yet sent on this connection, keeping at most ``max_in_flight``
        batches that the learner has not yet received."""
        if not self.connected:
            return
        for key in self.spool.pending():
            if len(self._in_flight) >= self.max_in_flight:
                break
            if key[1] < self._next_send:
                continue
            send_frames(self.sock, self.spool.read(key))
            if not self._in_flight:
                self._last_progress = time.monotonic()
            self._in_flight.append(key)
            self._next_send = key[1] + 1

    def act(self, arrays: dict[str, np.ndarray], tasks: list[str], *, deterministic: bool = False
            ) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
        """Actions [B, H, A] (finite), the policy version that produced them and the policy
        extras ``{"extra.<name>": [B, *shape]}`` (each extra the welcome's spec declares,
        checked). Retries a request that times out; after ``reconnect_after`` timeouts (or as
        long without a connection) it starts a new handshake in the background and raises
        :class:`ActError`, as it does when the learner answers with an error: the caller
        keeps its env safe meanwhile and asks again."""
        misses = 0
        give_up = time.monotonic() + self.timeout_s * self.reconnect_after
        while True:
            if self.sock is None:
                self._start_handshake()
            while not self.connected:
                if time.monotonic() > give_up:
                    raise ActError("not_connected", f"no welcome from the learner at {self.endpoint} "
                                   f"in {self.timeout_s * self.reconnect_after:.1f}s (still trying)")
                self._pump_handshake(0.2)
            self._req_id += 1
            req = self._req_id
            t0 = time.perf_counter()
            sock = self.act_sock or self.sock
            send_frames(sock, encode(
                "act", {"req_id": req, "deterministic": deterministic, "tasks": list(tasks)}, arrays))
            deadline = time.monotonic() + self.timeout_s
            wait_set = sock is self.act_sock  # the act socket's RCVTIMEO is timeout_s already
            while True:
                # a blocking receive with a timeout: no poller to build and tear down per act
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                if not wait_set:
                    sock.setsockopt(_RCVTIMEO, left_ms)
                wait_set = False
                try:  # frames: each says whether more follow (no getsockopt per part)
                    frames = recv_frames(sock, copy=False)
                except zmq.Again:
                    break
                msg = self._decode(frames)
                if msg is None:
                    continue
                if msg.type == "act_reply" and msg.fields["req_id"] == req:
                    self.last_act_ms = (time.perf_counter() - t0) * 1000.0
                    version = self.policy_version = msg.fields["policy_version"]
                    actions = np.array(msg.arrays["actions"])
                    if actions.dtype.kind != "f" or not np.isfinite(actions).all():
                        raise ActError("bad_reply", f"act reply of version {version}: actions "
                                       f"{actions.dtype.name}{actions.shape} are not finite floats")
                    try:
                        return actions, version, self._reply_extras(msg, len(actions))
                    except ValueError as exc:
                        raise ActError("bad_reply", str(exc)) from None
                if msg.type == "error" and msg["code"] in ("bad_observation", "inference_failed"):
                    raise ActError(msg["code"], f"the learner could not serve the act request: "
                                   f"{msg['message']}")
                # (a late act_reply is dropped; handshake_required from the act socket, a learner
                # that forgot this session, starts a new handshake and the request is resent)
                self._dispatch(msg)
                if not self.connected:
                    break
            if not self.connected:
                continue
            misses += 1
            if misses % self.reconnect_after == 0:
                self.reconnect(block=False)
                raise ActError("no_reply", f"no act reply from the learner at {self.endpoint} in "
                               f"{misses} x {self.timeout_s:.1f}s (reconnecting)")

    def _reply_extras(self, msg: Message, n: int) -> dict[str, np.ndarray]:
        declared = self.spec.extras if self.spec else {}
        if len(msg.arrays) == 1 and not declared:  # actions only, as declared: nothing to check
            return {}
        extras = {k: np.array(v) for k, v in msg.arrays.items() if k.startswith(EXTRA_PREFIX)}
        for name, (dt, shape) in declared.items():
            a = extras.get(EXTRA_PREFIX + name)
            if a is None or a.dtype != np.dtype(dt) or a.shape != (n, *shape):
                got = "nothing" if a is None else f"{a.dtype.name}{tuple(a.shape)}"
                raise ValueError(f"act reply: extra {name!r} is {got}, the learner declared "
                                 f"{dt}{(n, *shape)}")
        return extras

    def get_job(self, episode: int) -> Job | None:
        """The learner's job for ``episode`` (the episode this actor is about to start), or None: the
        learner hands out no jobs (welcome ``jobs`` false), has none now (``no_job``), or did not answer
        within ``timeout_s`` (then the actor runs as it likes; logged once per outage, and after
        ``reconnect_after`` such misses the socket is rebuilt as for other requests)."""
        deadline = time.monotonic() + self.timeout_s
        sent_on = None  # the connection (learner id, socket) the request went out on
        while time.monotonic() < deadline:
            if self.sock is None or not self.connected:
                self._pump_handshake(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            if not self.jobs:
                return None
            if sent_on != (self.learner_id, id(self.sock)):
                self.sock.send_multipart(encode("get_job", {"episode": int(episode)}))
                sent_on = (self.learner_id, id(self.sock))
            if not self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            msg = self._recv()
            if msg is None:
                continue
            if msg.type in ("job", "no_job") and msg["episode"] == episode:
                self._job_misses, self._job_warned = 0, False
                if msg.type == "no_job":
                    return None
                try:
                    return Job.from_fields(msg)
                except (KeyError, TypeError, ValueError) as exc:
                    log.error("bad job from learner for episode %d: %s", episode, exc)
                    return None
            if msg.type == "error" and msg["code"] in ("job_failed", "bad_request"):
                log.error("learner could not give a job for episode %d: %s", episode, msg["message"])
                return None
            if msg.type in ("job", "no_job"):
                continue  # a late answer for an earlier episode
            self._dispatch(msg)
        if self.connected and not self.jobs:
            return None
        self._job_misses += 1
        if not self._job_warned:
            log.warning("no job from the learner for episode %d within %.1fs: running it as this "
                        "actor likes (logged once until the learner answers again)", episode,
                        self.timeout_s)
            self._job_warned = True
        if self.connected and self._job_misses % self.reconnect_after == 0:
            self.reconnect(block=False)
        return None

    def request_weights(self, have_version: int = -1) -> Message | None:
        """Ask for the latest weights over the reliable channel; returns the message or None."""
        self.weights_msg = None
        self.sock.send_multipart(encode("get_weights", {"have_version": have_version}))
        deadline = time.monotonic() + self.timeout_s
        while self.weights_msg is None and time.monotonic() < deadline:
            self.poll(0.05)
        return self.weights_msg

    def stats(self) -> dict[str, Any]:
        return {"unacked": len(self.spool), "spool_mb": self.spool.nbytes / 2**20, "reconnects": self.reconnects,
                "version": self.policy_version, "dead_letters": self.spool.dead_letters}
