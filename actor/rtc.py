"""Real-time chunking on the actor (``chunk.rtc=true``; docs/rtc.md): the next action chunk is
asked for while the current one runs, and joined to it.

:class:`RtcChunker` gives the control loop one action per step:

- the first chunk of an episode (or after a failed request) is asked for and waited for, as
  without RTC;
- once the current chunk has run up to ``s - d`` (``s``: ``chunk.execute``, the whole chunk when
  0; ``d``: the estimated delay in steps), the next request goes out *without waiting*
  (:class:`AsyncAct`) with the current observation, the chunk's not yet executed actions (the
  pending prefix, ``rtc.prefix`` / ``rtc.pending``) and ``d`` (``rtc.delay``); the loop keeps
  executing the current chunk and checks for the reply before each step;
- when the reply arrives, ``k`` steps after the request, the new chunk takes over at its index
  ``k`` (its actions 0..k-1 were for the steps that already ran; the learner froze its first
  ``d`` actions to the prefix, so with ``k <= d`` the join is the prefix itself). If the
  current chunk runs out first, the loop waits for the reply (a stall, counted).

``d`` is ``ceil(latency / step period)`` with the largest act latency of the last
:data:`WINDOW` asynchronous requests (lerobot's ``LatencyTracker`` uses the same maximum; the
last waited-for one until there are any) and the mean period of the loop's steps outside this
class, clamped to the pending actions. The receive
runs on the loop's thread between env steps: nothing waits on a socket thread, and no
inference runs on the actor.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import zmq

from actor.client import ActError, LearnerClient
from data.core.codec import encode, recv_frames, send_frames
from data.core.schema import RTC_DELAY, RTC_PENDING, RTC_PREFIX

#: act latencies remembered for the delay estimate
WINDOW = 10


class AsyncAct:
    """One act request in flight on the client's act socket (the main one without it)."""

    def __init__(self, client: LearnerClient, arrays: dict, tasks: list[str], deterministic: bool):
        if client.sock is None or not client.connected:
            raise ActError("not_connected", f"no session with the learner at {client.endpoint}")
        client._req_id += 1  # noqa: SLF001 - the client's request ids, shared with its sync act
        self.client, self.req = client, client._req_id  # noqa: SLF001
        self.sock = client.act_sock or client.sock
        self.t0 = time.perf_counter()
        self.steps = 0  # control steps executed since the request went out
        # on the main socket the client's poll (acks, heartbeats) may read the reply first
        self.inbox: list = []
        client.on_act_reply = self.inbox.append
        send_frames(self.sock, encode("act", {"req_id": self.req, "deterministic": deterministic,
                                              "tasks": list(tasks)}, arrays))

    def close(self) -> None:
        if self.client.on_act_reply == self.inbox.append:
            self.client.on_act_reply = None

    def _take(self, msg):
        """The reply for this request (or None for another message); raises on a refusal."""
        c = self.client
        if msg.type == "act_reply" and msg.fields["req_id"] == self.req:
            self.close()
            c.note_act_ms((time.perf_counter() - self.t0) * 1000.0)
            version = c.policy_version = msg.fields["policy_version"]
            actions = np.array(msg.arrays["actions"])
            if actions.dtype.kind != "f" or not np.isfinite(actions).all():
                raise ActError("bad_reply", f"act reply of version {version}: actions are not finite floats")
            try:
                return actions, version, c._reply_extras(msg, len(actions))  # noqa: SLF001
            except ValueError as exc:
                raise ActError("bad_reply", str(exc)) from None
        if msg.type == "error":
            self.close()
            raise ActError(msg["code"], f"the learner could not serve the act request: {msg['message']}")
        return None

    def poll(self, timeout_s: float = 0.0):
        """(actions [B, H, A], version, extras) once the reply is here, else None after
        ``timeout_s``; raises :class:`ActError` on the learner's refusal or a lost session."""
        c, sock = self.client, self.sock
        deadline = time.monotonic() + timeout_s
        while True:
            while self.inbox:
                got = self._take(self.inbox.pop(0))
                if got is not None:
                    return got
            if not c.connected or c.sock is None:
                self.close()
                raise ActError("not_connected", "the learner asked for a new handshake")
            left = deadline - time.monotonic()
            if not sock.poll(max(0, int(left * 1000))):
                return None
            msg = c.session.decode(recv_frames(sock, zmq.NOBLOCK, copy=sock is not c.act_sock))
            if msg is not None:
                c._dispatch(msg)  # noqa: SLF001 - acks, pongs, a new handshake; this act's reply: the inbox


@dataclass
class RtcStep:
    action: np.ndarray
    index: int          # position in the chunk it comes from
    start: bool         # the first action executed of a new chunk
    version: int
    extras: dict        # the reply's extras ({"extra.<name>": [1, ...]}), new chunk only


class RtcChunker:
    def __init__(self, client: LearnerClient, act_fn, *, execute: int = 0):
        self.client, self.act_fn, self.execute = client, act_fn, int(execute)
        self.latency: deque[float] = deque(maxlen=WINDOW)  # async requests' (what the estimate reads)
        self.sync_latency: deque[float] = deque(maxlen=WINDOW)  # waited-for requests' (until there are those)
        self.period_s = 0.0        # mean control step period outside this class
        self._out_at: float | None = None
        self.chunk: np.ndarray | None = None
        self.ci = 0
        self.flight: AsyncAct | None = None
        self._fresh = None         # (version, extras) of a chunk whose first step is next
        self.sent_delay = 0
        # what the operator and docs/rtc.md read
        self.requests = self.joins = self.stalls = 0
        self.stall_s = 0.0
        self.delays: list[tuple[int, int]] = []  # (delay sent, steps it took) per join

    def reset(self) -> None:
        """A new episode, or a person took over: no chunk, the request in flight is dropped
        (its late reply is discarded by request id)."""
        if self.flight is not None:
            self.flight.close()
        self.chunk, self.flight, self._fresh, self._out_at = None, None, None, None

    def estimate(self, pending: int) -> int:
        if self.period_s <= 0 or not (self.latency or self.sync_latency):
            return 0
        lat = max(self.latency) if self.latency else self.sync_latency[-1]
        return max(0, min(pending, math.ceil(lat / self.period_s)))

    def _take(self, got, at: int) -> None:
        actions, version, extras = got
        self.chunk, self.ci = np.asarray(actions[0], np.float32), at
        self._fresh = (version, extras)

    def _join(self, got) -> None:
        f, self.flight = self.flight, None
        self.latency.append(time.perf_counter() - f.t0)
        self.delays.append((self.sent_delay, f.steps))
        self.joins += 1
        self._take(got, f.steps)

    def next(self, obs_arrays: dict, tasks: list[str], deterministic: bool) -> RtcStep:
        """The action for this step (raises :class:`ActError` when there is none: the loop
        holds the env and asks again)."""
        now = time.perf_counter()
        if self._out_at is not None:
            dt = now - self._out_at
            self.period_s = dt if self.period_s <= 0 else 0.8 * self.period_s + 0.2 * dt
        try:
            return self._next(obs_arrays, tasks, deterministic)
        finally:
            self._out_at = time.perf_counter()

    def _next(self, obs_arrays, tasks, deterministic) -> RtcStep:
        if self.flight is not None:
            try:
                got = self.flight.poll(0.0)
                if got is None and self.ci >= len(self.chunk):  # ran out: the robot waits
                    self.stalls += 1
                    t0 = time.perf_counter()
                    got = self.flight.poll(self.client.timeout_s * self.client.reconnect_after)
                    self.stall_s += time.perf_counter() - t0
                    if got is None:
                        raise ActError("no_reply", f"no act reply in {self.client.timeout_s * self.client.reconnect_after:.1f}s")
            except ActError:
                self.reset()
                raise
            if got is not None:
                self._join(got)
        if self.chunk is None or self.ci >= len(self.chunk):
            t0 = time.perf_counter()
            self._take(self.act_fn(obs_arrays, tasks, deterministic), 0)
            self.sync_latency.append(time.perf_counter() - t0)
        h = len(self.chunk)
        pending = h - self.ci
        if self.flight is None and pending > 0 and self.ci >= (self.execute or h) - self.estimate(pending):
            self.sent_delay = self.estimate(pending)
            prefix = np.zeros((1, *self.chunk.shape), np.float32)
            prefix[0, :pending] = self.chunk[self.ci:]
            arrays = dict(obs_arrays)
            arrays.update({RTC_PREFIX: prefix, RTC_DELAY: np.array([self.sent_delay], np.int64),
                           RTC_PENDING: np.array([pending], np.int64)})
            self.flight = AsyncAct(self.client, arrays, tasks, deterministic)
            self.requests += 1
        step = RtcStep(self.chunk[self.ci], self.ci, self._fresh is not None,
                       *(self._fresh if self._fresh is not None else (-1, {})))
        self._fresh = None
        self.ci += 1
        if self.flight is not None:
            self.flight.steps += 1
        return step
