"""The learner's socket thread: requests and replies on the main socket, weight versions on
the PUB socket.

The network-facing sockets are the wire gate's, a process of their own (:mod:`data.core.gate`,
:mod:`learner.server_sockets`: a peer can neither abort the learner through libzmq nor make it
buffer more than the message limits; a gate that dies is started again from this thread's
loop). This thread owns the learner's ends of the main and PUB sockets; other threads
(inference, trainer) hand it outgoing messages through an inproc PUSH -> PULL channel
(:meth:`outbox`), so no ZMQ socket is ever shared between threads and inference never runs
here.

Per message from an actor (first frame: the peer's routing identity, as a ROUTER gives it):

- ``hello``: checks protocol (codec) and config hash, registers the actor, replies
  ``welcome`` with the actor's acknowledged sequence number and the current version;
- ``act``: validates the observation and queues it for the inference thread. Actors that
  got an ``act_port`` in their welcome send acts to the act socket instead
  (:mod:`learner.act_channel`: the inference thread reads, validates and answers them itself,
  with no hand-off through this thread); both paths decode and validate through one
  :class:`learner.act_intake.ActIntake` (optional real-time-chunking arrays, ``rtc.*``,
  refused with ``bad_request`` naming the problem);
- ``transitions``: validates, drops duplicates by sequence number, hands new records to
  :class:`learner.ingest.Ingest` and replies ``ack`` with the durable sequence number; a batch
  refused as a whole (its layout, schema, value ranges or episode checks) is answered with
  ``batch_rejected`` naming its records, which are consumed (the ack after it covers them);
- ``ping`` -> ``pong``; ``get_weights`` -> ``weights``; ``bye`` forgets the peer;
- ``get_job`` (episode id the actor is about to start): ``job`` (the episode to run exactly,
  from ``next_job(actor_id, episode)``) or ``no_job``. The welcome's ``jobs`` says whether
  this learner hands out jobs at all; its ``spec`` is the env layout with the policy extras
  that records must carry.

Anything malformed, oversized (the gate's ``message_too_large``), unknown or out of order
gets an ``error`` reply naming what is wrong, and the loop keeps serving: any exception from one message (not only the codec's)
becomes an ``internal_error`` reply and a count in ``counters["internal_errors"]``. Every
rejection is counted by code (``rejections``); their WARNINGs are rate-limited. If the thread
dies anyway, ``on_fatal(exc)`` is called (the learner app stops loudly with the cause;
without one the main thread is interrupted), never leaving a half-alive learner.

Identities: an actor id is owned by one session at a time. With CURVE keys it is bound to
the key (``<actor_id>.key`` in the authorised-keys folder, :mod:`data.core.security`): a
hello naming another id is refused, and the key's holder may take over its id from a stale
session. Without keys the first live session owns the id until it is silent for
``peer_timeout_s``; a hello claiming it meanwhile gets ``actor_id_in_use`` (the actor retries),
unless it carries the same ``instance`` token as that session's hello (the same actor process
retrying its handshake with a new socket, e.g. hellos queued while the learner was starting).
A hello naming a new actor id once ingest keeps state for ``max_actor_ids`` ids gets
``too_many_actors``. A ``resend_from`` beyond what this learner acknowledged (``bad_resend``) is refused when the
acks are durable (an episode store), or, without one, once this process has acknowledged that
actor's records; before that a restarted learner cannot know what an earlier process
acknowledged, and skips the gap as lost records (logged).
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
import uuid
from collections import Counter
from typing import Callable

import numpy as np
import zmq

from data.core.codec import encode, send_frames
from data.core.jobs import Job
from data.core.schema import MAX_BATCH
from data.core.transitions import TransitionBatch, TransitionError
from data.core.spec import EnvSpec
from learner.handshake import on_hello
from learner.peers import Peer
from learner.ingest import Ingest
from learner.act_intake import ActIntake, ActRequest, decode_request
from learner.act_channel import ActChannel, drain as _drain, is_act_token
from learner.server_sockets import Outboxes, open_server_sockets, send_or_drop
from learner.wire_guard import RateLimitedLog, check_obs, check_transitions_message
from data.core.security import authorized_actor_ids

log = logging.getLogger("tandem.learner.service")

OUTBOX_ADDR = "inproc://tandem-outbox"
#: messages handled per wake-up between ack sends (acks of a burst of batches are coalesced)
ACK_EVERY = 4
__all__ = ["ActRequest", "LearnerService", "Peer", "check_obs"]


class LearnerService(threading.Thread):
    def __init__(
        self,
        *,
        ctx: zmq.Context,
        spec: EnvSpec,
        config_hash: str,
        ingest: Ingest,
        submit_act: Callable[[ActRequest], None],
        get_version: Callable[[], int],
        get_weights: Callable[[], tuple[int, dict[str, np.ndarray], list[str]] | None],
        host: str = "127.0.0.1",
        port: int = 5588,
        pub_port: int = 5589,
        max_message_bytes: int = 64 << 20,
        peer_timeout_s: float = 10.0,
        mode: str = "train",
        security: dict | None = None,
        next_job: Callable[[str, int], Job | None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        act_port: int | None = None,
        act_socket: bool = True,
        gate_memory_bytes: int = 4 << 30,
        max_actor_ids: int = 4096,
        rtc_chunk: int = 0,
    ):
        """``act_port``: the act socket's port (:mod:`learner.act_channel`); None: ``port + 2``
        (5590 by default; one the OS picks when that is taken or ``port`` is 0; the welcome
        tells actors which). ``act_socket=False``: none, every act goes through the main
        socket. ``gate_memory_bytes``: the wire gate's memory cap (:mod:`data.core.gate`).
        ``max_actor_ids``: hellos naming a new actor id are refused (``too_many_actors``) once
        ingest keeps state for that many (the state of every id is kept for good).
        ``rtc_chunk``: the policy's chunk when this learner serves real-time chunking (act
        requests may carry RTC arrays, :func:`learner.wire_guard.check_rtc`), 0 when not."""
        super().__init__(name="tandem-service", daemon=True)
        self.ctx = ctx
        self.spec = spec
        self.config_hash = config_hash
        self.ingest = ingest
        self.submit_act = submit_act
        self.get_version = get_version
        self.get_weights = get_weights
        self.max_message_bytes = max_message_bytes
        self.peer_timeout_s = peer_timeout_s
        self.mode = mode
        self.next_job = next_job
        self.max_actor_ids = int(max_actor_ids)
        self.rtc_chunk = int(rtc_chunk)
        self.learner_id = uuid.uuid4().hex[:12]
        self.peers: dict[bytes, Peer] = {}
        #: act token -> session (read by the inference thread; written here only)
        self.act_sessions: dict[bytes, Peer] = {}
        self._count_lock = threading.Lock()  # counters are written by two threads
        self.counters = {"rejected": 0, "duplicates": 0, "acts": 0, "transitions": 0, "jobs": 0,
                         "internal_errors": 0}
        self.rejections: Counter[str] = Counter()  # by error code
        self._warn = RateLimitedLog(log)
        self.on_fatal = on_fatal
        self.error: BaseException | None = None  # why the thread died, if it did
        security = security or {}
        # z85 public key -> actor id, when actors authenticate with CURVE keys
        self.key_ids = (authorized_actor_ids(security["authorized_keys_dir"])
                        if security.get("server_secret_key") else None)
        self.finished = False  # eval done: tell actors to stop
        self._stop_event = threading.Event()
        self._outboxes = Outboxes(ctx, OUTBOX_ADDR + "-" + self.learner_id)
        #: identity -> (actor id, acked seq): acks owed for transitions handled in this wake-up
        self._acks_owed: dict[bytes, tuple[str, int]] = {}
        self.counters["dropped_replies"] = 0  # replies the gate could not take (restarting, full)
        # Bind in the constructor so that port errors surface in the caller's thread. The
        # network-facing sockets are the wire gate's (learner/server_sockets.py): no peer can
        # abort this process or make it buffer without bound.
        self._curve = bool(security.get("server_secret_key"))
        self.sockets = open_server_sockets(
            ctx, host=host, port=port, pub_port=pub_port, act_port=act_port, act_socket=act_socket,
            security=security, max_message_bytes=max_message_bytes, memory_bytes=gate_memory_bytes)
        self.gate = self.sockets.gate
        self.router, self.pub = self.sockets.main, self.sockets.pub
        self.port, self.pub_port = self.sockets.port, self.sockets.pub_port
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(OUTBOX_ADDR + "-" + self.learner_id)
        self.act_intake = ActIntake(self)  # both act paths decode and validate through it
        self.act_channel: ActChannel | None = None
        if self.sockets.act is not None:
            self.act_channel = ActChannel(self, self.sockets.act, self.sockets.act_port)

    # ---- API for other threads -------------------------------------------------------

    def outbox(self) -> zmq.Socket:
        """This thread's PUSH socket into the service thread (created once per thread)."""
        return self._outboxes.get().sock

    def reply(self, identity: bytes, frames: list) -> None:
        """Send from any thread: via the outbox, or straight on the act socket (its thread)."""
        ch = self.act_channel
        if ch is not None and ch.owner == threading.get_ident() and is_act_token(identity):
            ch.send(identity, frames)
            return
        self._push([b"R", identity, *frames])

    def publish(self, frames: list) -> None:
        self._push([b"P", *frames])

    def _push(self, frames: list) -> None:
        if self._outboxes.push(frames):
            return
        with self._count_lock:  # the socket thread is gone (or stuck): dropped, counted
            self.counters["dropped_replies"] += 1
        if not self.is_alive():
            self._warn.warning("the socket thread is not running: a message to send was dropped")

    def active_actors(self) -> int:
        now = time.monotonic()
        # list(): one C-level copy, safe while the socket thread adds a peer
        return len([p for p in list(self.peers.values()) if now - p.last_seen < self.peer_timeout_s])

    def count_rejection(self, code: str, *, internal: bool = False) -> None:
        with self._count_lock:
            self.counters["internal_errors" if internal else "rejected"] += 1
            if not internal:
                self.rejections[code] += 1

    def stop(self) -> None:
        self._stop_event.set()

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        skip = 2 if self._curve else 1  # [routing id, (CURVE User-Id,) message...]
        try:
            while not self._stop_event.is_set():
                events = dict(poller.poll(100))
                if self.pull in events:
                    for frames in _drain(self.pull, ready=True):
                        if frames[0].bytes == b"R":
                            self._out(frames[1:])
                        else:
                            send_frames(self.pub, frames[1:])
                if self.router in events:
                    for i, frames in enumerate(_drain(self.router, ready=True), 1):
                        self._handle_safe(frames[0].bytes, frames[skip:],
                                          frames[1].bytes.decode("ascii", "replace") if skip == 2 else None)
                        if i % ACK_EVERY == 0:
                            self._send_acks()
                    self._send_acks()
                if self.gate.poll():  # it died (a crafted peer, its memory cap): a new one serves
                    self.counters["gate_restarts"] = self.gate.restarts
        except BaseException as exc:
            self.error = exc
            log.critical("the learner's socket thread died: %s: %s", type(exc).__name__, exc,
                         exc_info=exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)
            else:
                _thread.interrupt_main()
        finally:
            for s in (self.router, self.pub, self.pull):
                s.close(0)
            self.gate.stop()
            if self.act_channel is not None:  # the inference thread closes it if it took it
                self.act_channel.close(unless_owned=True)
            self._outboxes.close_all()

    def _out(self, frames: list) -> None:
        """``[routing id, frames...]`` to the gate, or dropped (counted) when it cannot take it."""
        if not send_or_drop(self.router, frames):
            self.counters["dropped_replies"] += 1

    def _send_acks(self) -> None:
        while self._acks_owed:
            identity, (actor_id, acked) = self._acks_owed.popitem()
            self._out([identity, *self.ack_frames(actor_id, acked)])

    def _send(self, identity: bytes, frames: list) -> None:
        if identity in self._acks_owed:  # what this peer is owed goes first, in order
            actor_id, acked = self._acks_owed.pop(identity)
            self._out([identity, *self.ack_frames(actor_id, acked)])
        self._out([identity, *frames])

    def _error(self, identity: bytes, code: str, message: str) -> None:
        self.count_rejection(code)
        self._warn.warning("rejected message from %s: %s: %s",
                           self.peers[identity].actor_id if identity in self.peers else identity.hex(),
                           code, message[:500])
        self._send(identity, encode("error", {"code": code, "message": message}))

    def _handle_safe(self, identity: bytes, frames: list, user_id: str | None = None) -> None:
        """One message (``user_id``: the sender's CURVE key, z85): whatever it raises becomes an
        error reply and a count, never the end of this thread."""
        try:
            self._handle(identity, frames, user_id)
        except Exception as exc:
            self.count_rejection("internal_error", internal=True)
            self._warn.warning("message from %s raised %s (counted, serving on)", identity.hex(),
                               type(exc).__name__, exc_info=exc)
            try:
                self._error(identity, "internal_error",
                            f"the learner could not process this message: {type(exc).__name__}: "
                            f"{str(exc)[:200]}")
            except Exception:  # the reply itself failed (the peer is gone): counted above
                pass

    def _handle(self, identity: bytes, frames: list, user_id: str | None = None) -> None:
        if not frames:
            self._error(identity, "bad_message", "empty message")
            return
        msg = decode_request(frames, self.max_message_bytes)
        if type(msg) is tuple:
            self._error(identity, *msg)
            return
        if msg.type == "hello":
            self._on_hello(identity, msg, user_id)
            return
        peer = self.peers.get(identity)
        if peer is None:
            self._error(identity, "handshake_required", f"send hello before {msg.type!r}")
            return
        peer.last_seen = time.monotonic()
        try:
            handler = {
                "act": self._on_act,
                "transitions": self._on_transitions,
                "ping": self._on_ping,
                "get_weights": self._on_get_weights,
                "bye": self._on_bye,
                "get_job": self._on_get_job,
            }[msg.type]
        except KeyError:
            self._error(identity, "unexpected_type", f"{msg.type!r} is not a request")
            return
        handler(identity, peer, msg)

    def _on_hello(self, identity: bytes, msg, user_id: str | None = None) -> None:
        on_hello(self, identity, msg, user_id)

    def _on_act(self, identity: bytes, peer: Peer, msg) -> None:
        req = self.act_intake.validate(identity, msg, peer.actor_id)
        if type(req) is tuple:
            code, message = req
            if code == "finished":
                self._send(identity, encode("error", {"code": code, "message": message}))
            else:
                self._error(identity, code, message)
            return
        self.submit_act(req)

    def _on_transitions(self, identity: bytes, peer: Peer, msg) -> None:
        if msg["actor_id"] != peer.actor_id:
            self._error(identity, "bad_actor", f"batch claims actor {msg['actor_id']!r}, "
                        f"connection is {peer.actor_id!r}")
            return
        err = check_transitions_message(msg)
        if err:
            self._reject(identity, peer.actor_id, msg["first_seq"], msg["last_seq"],
                         "bad_seq" if err.startswith("last_seq") else "bad_transitions", err,
                         msg.arrays.get("episode"))
            return
        batch = TransitionBatch.from_message(msg)
        try:
            batch.validate(self.spec)
        except TransitionError as exc:
            # Invalid records are consumed (counted, logged, never stored) so that the actor's
            # stream goes on; nothing stored before changes.
            self.ingest.count_rejection(str(exc))
            self._reject(identity, peer.actor_id, batch.first_seq, batch.last_seq, "bad_transitions",
                         f"seq {batch.first_seq}..{batch.last_seq}: {exc}", batch.arrays.get("episode"))
            return
        try:
            acked, dup, rejected = self.ingest.add(batch)
        except TransitionError as exc:  # sequence gap: the actor resends from its ack
            self._error(identity, "bad_transitions", str(exc))
            return
        self.counters["duplicates"] += dup
        if rejected is not None:  # an episode-level problem: consumed, counted by ingest
            self.count_rejection("bad_episode")
            self._send(identity, encode("batch_rejected", {
                "first_seq": batch.first_seq, "last_seq": batch.last_seq, "code": "bad_episode",
                "message": f"seq {batch.first_seq}..{batch.last_seq}: {rejected}"[:1000]}))
        else:
            self.counters["transitions"] += len(batch) - dup
        self._ack(identity, peer.actor_id, acked)

    def _reject(self, identity: bytes, actor_id: str, first: int, last: int, code: str,
                message: str, episodes) -> None:
        """A batch refused as a whole: its sequence numbers are consumed (unless a gap comes
        before them, or they are no range of 1..MAX_BATCH records) and the actor gets a typed
        ``batch_rejected`` naming them, then the ack; otherwise an ``error``."""
        if not 0 <= last - first < MAX_BATCH:
            self._error(identity, code, message)
            return
        try:
            acked = self.ingest.skip_range(actor_id, first, last, episodes)
        except TransitionError as exc:  # after a gap: the actor resends from its ack first
            self._error(identity, "bad_transitions", f"{exc} (a rejected batch)")
            return
        self.count_rejection(code)
        self._warn.warning("rejected batch seq %d..%d of %s: %s: %s", first, last, actor_id, code,
                           message[:500])
        self._send(identity, encode("batch_rejected", {"first_seq": first, "last_seq": last,
                                                       "code": code, "message": message[:1000]}))
        self._ack(identity, actor_id, acked)

    def ack_frames(self, actor_id: str, acked: int) -> list:
        received = max(acked, self.ingest.received.get(actor_id, -1))
        return encode("ack", {"acked_seq": acked, "received_seq": received,
                              "policy_version": self.get_version()})

    def _ack(self, identity: bytes, actor_id: str, acked: int) -> None:
        """Owe ``identity`` an ack, sent after the messages waiting now (ACK_EVERY at most) or
        before any other reply to it: one ack (cumulative, the newest) covers that stretch."""
        self._acks_owed[identity] = (actor_id, acked)

    def _on_ping(self, identity: bytes, peer: Peer, msg) -> None:
        if self.finished:
            self._send(identity, encode("error", {"code": "finished", "message": "evaluation is done"}))
            return
        self._send(identity, encode("pong", {"t": msg["t"], "policy_version": self.get_version()}))

    def _on_get_weights(self, identity: bytes, peer: Peer, msg) -> None:
        snap = self.get_weights()
        if snap is None:
            self._error(identity, "no_weights", "no weights published yet")
            return
        version, arrays, bf16 = snap
        self._send(identity, encode("weights", {"policy_version": version, "bf16": bf16}, arrays))

    def _on_bye(self, identity: bytes, peer: Peer, msg) -> None:
        self.peers.pop(identity, None)
        self.act_sessions.pop(peer.token, None)

    def _on_get_job(self, identity: bytes, peer: Peer, msg) -> None:
        episode = msg["episode"]
        if not 0 <= episode <= 2**62:
            self._error(identity, "bad_request", f"get_job: episode {episode} out of range")
            return
        if self.finished:
            self._send(identity, encode("error", {"code": "finished", "message": "evaluation is done"}))
            return
        job = None
        if self.next_job is not None:
            try:
                job = self.next_job(peer.actor_id, episode)
            except Exception as exc:  # a broken job source must not stop the service
                log.exception("job source failed")
                self._error(identity, "job_failed", f"{type(exc).__name__}: {exc}")
                return
        if job is None:
            self._send(identity, encode("no_job", {"episode": episode}))
            return
        self.counters["jobs"] += 1
        self._send(identity, encode("job", {**job.to_fields(), "episode": episode}))
