"""The actor's connection to the learner, used from one thread: over an
:class:`actor.session.Session` (the sockets, the handshake and what the welcome said) it asks
for actions, streams spooled transition batches and processes acks, with timeouts, retries
and heartbeats. When the learner stops answering (restart, dropped link) it closes the socket, opens a new one and handshakes again ("lazy pirate"); the
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
from typing import Any

import numpy as np
import zmq

from actor.session import LearnerFinished, Session
from actor.spool import Spool
from data.core.codec import Message, encode, recv_frames, send_frames
from data.core.jobs import Job
from data.core.latency import LatencyHistogram
from data.core.schema import EXTRA_PREFIX

log = logging.getLogger("tandem.actor.client")
# plain ints: pyzmq's enum members cost Python-level enum code in & and in setsockopt
_POLLIN, _RCVTIMEO = int(zmq.POLLIN), int(zmq.RCVTIMEO)


class ActError(RuntimeError):
    """No actions for this request: the learner could not serve it (``inference_failed``, ``bad_observation``),
    sent an unusable reply (``bad_reply``) or did not answer in time (``no_reply``, ``not_connected``).
    Never final: the actor holds its env safe and retries (:class:`actor.loop.ActorLoop`)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def _from_session(name: str) -> property:
    return property(lambda self: getattr(self.session, name), doc=f"the session's ``{name}`` (read-only)")


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
        self.spool = spool
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_after = reconnect_after
        self.max_in_flight = max_in_flight
        #: the sockets, the handshake and what the last welcome said
        self.session = Session(ctx=ctx, host=host, port=port, actor_id=actor_id, config_hash=config_hash,
                               spool=spool, timeout_s=timeout_s, security=security or {},
                               max_message_bytes=max_message_bytes)
        self._job_warned = False
        self._job_misses = 0
        self.policy_version = 0
        self._req_id = 0
        self._in_flight: list[tuple[int, int]] = []  # sent, not yet received by the learner
        self._next_send = 0  # first sequence number not yet sent on this connection
        self._received = -1  # the learner has every record <= this
        self._last_ping = 0.0
        self._last_progress = 0.0
        self.weights_msg: Message | None = None
        self.last_act_ms, self.on_act_reply = 0.0, None
        #: every act's round trip (request sent -> reply decoded), the whole run
        self.act_hist = LatencyHistogram()

    # the session's state, read here by the actor's loop, its policies and tools
    sock = _from_session("sock")
    act_sock = _from_session("act_sock")
    connected = _from_session("connected")
    learner_id = _from_session("learner_id")
    endpoint = _from_session("endpoint")
    instance = _from_session("instance")
    reconnects = _from_session("reconnects")
    mode = _from_session("mode")
    #: the learner's spec from the last welcome (env layout + policy extras), or None
    spec = _from_session("spec")
    #: the learner hands out jobs (ask with :meth:`get_job` before each reset)
    jobs = _from_session("jobs")

    # ---- connection ----------------------------------------------------------------------

    def _pump_handshake(self, timeout_s: float) -> None:
        welcome = self.session.pump(timeout_s)
        if welcome is not None:
            self._on_welcome(welcome)

    def connect(self, *, give_up_after_s: float | None = None) -> None:
        """Handshake, retrying until the learner answers (or ``give_up_after_s`` passes)."""
        start = time.monotonic()
        self.session.start()
        while not self.connected:
            self._pump_handshake(min(0.2, self.timeout_s))
            if give_up_after_s is not None and time.monotonic() - start > give_up_after_s:
                raise TimeoutError(f"no learner answered at {self.endpoint} in {give_up_after_s:.0f}s")

    def _on_welcome(self, msg: Message) -> None:
        """Open the session, then continue the transition stream where the learner has it."""
        self.session.accept(msg)
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
        self._last_ping = self._last_progress = time.monotonic()
        log.info("connected to learner %s at %s: acked seq %d, %d records to resend, version %d, "
                 "mode %s, extras %s, jobs %s", self.learner_id, self.endpoint, acked, len(self.spool),
                 self.policy_version, self.mode, sorted(self.spec.extras), self.jobs)
        self.flush()

    def reconnect(self, *, block: bool = True) -> None:
        log.warning("learner at %s silent; reconnecting", self.endpoint)
        if block:
            self.connect()
        else:
            self.session.start()

    def close(self) -> None:
        self.session.close()

    # ---- receiving -----------------------------------------------------------------------

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
                self.session.start()
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
                msg = self.session.recv()
                if msg is not None:
                    self._dispatch(msg)
                continue
            break
        now = time.monotonic()
        if self._in_flight and now - self._last_progress > self.timeout_s:
            self._resend()  # nothing arrived for a while: resend what is pending
        if now - self.session.last_rx > self.heartbeat_s and now - self._last_ping > self.heartbeat_s:
            self.sock.send_multipart(encode("ping", {"t": time.time()}))
            self._last_ping = now
        if now - self.session.last_rx > self.heartbeat_s * self.reconnect_after + self.timeout_s:
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
                self.session.start()
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
                msg = self.session.decode(frames)
                if msg is None:
                    continue
                if msg.type == "act_reply" and msg.fields["req_id"] == req:
                    self.note_act_ms((time.perf_counter() - t0) * 1000.0)
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

    def note_act_ms(self, ms: float) -> None:
        """An act's round trip, in ms: the last one and the run's histogram."""
        self.last_act_ms = ms
        self.act_hist.add(ms)

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
            msg = self.session.recv()
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
                "version": self.policy_version, "dead_letters": self.spool.dead_letters,
                **self.act_hist.summary("act")}
