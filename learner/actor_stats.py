"""Per-actor statistics for the operator's view and ``status.json``.

Fed from three threads, read from a fourth:

- the socket thread: :meth:`ActorStats.on_act` (an act request arrived) and, through
  ingest, :meth:`ActorStats.on_records` (new records of an actor, under ingest's lock);
- the inference thread: :meth:`ActorStats.on_reply` (the reply to an act request left);
- the main or console thread: :meth:`ActorStats.rows`.

Per actor it keeps: env steps and their rate, the server-side act latency (request received
-> reply handed to the socket thread; p50 and p99 over the last 200, and a histogram over the
whole run: :class:`data.core.latency.LatencyHistogram`), the newest policy version seen in its
records, and the outcome of its last ``window`` episodes (success, whether a human intervened).
Over all actors: the act latency's histogram of the whole run (:meth:`ActorStats.act_latency`,
in ``status.json`` and every ``metrics.jsonl`` line) and of the period since the last
:meth:`ActorStats.take_period` (the logging period's ``act_p50_ms_recent`` /
``act_p99_ms_recent``).

The server-side latency is what serving adds: the wait for a batch, the forward pass (and any
wait behind training kernels on a shared GPU), and the hand-over to the socket thread; the
network, the wire gate and the actor's own decoding are not in it (an actor's round trip,
``act`` in its log line, holds them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from data.core.latency import LatencyHistogram

#: an actor that sent an act request this recently counts as ``remote``
REMOTE_WITHIN_S = 10.0


@dataclass
class _PerActor:
    steps: int = 0
    episodes: int = 0
    version: int = -1                      # newest policy_version in its records
    last_act: float = 0.0                  # monotonic time of its last act request
    last_records: float = 0.0
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=200))
    latency_hist: LatencyHistogram = field(default_factory=LatencyHistogram)  # the whole run
    outcomes: deque = field(default_factory=deque)   # (success, intervened) per episode
    rate: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, steps)
    open_intervened: dict = field(default_factory=dict)  # episode -> any step intervened


class ActorStats:
    def __init__(self, *, window: int = 20):
        self.window = int(window)
        self._lock = threading.Lock()
        self._actors: dict[str, _PerActor] = {}
        self._pending_acts: dict[bytes, deque] = {}   # identity -> receive times
        self._run = LatencyHistogram()      # every actor's act latency, the whole run
        self._period = LatencyHistogram()   # since the last take_period()

    def _actor(self, actor_id: str) -> _PerActor:
        a = self._actors.get(actor_id)
        if a is None:
            a = self._actors[actor_id] = _PerActor(outcomes=deque(maxlen=self.window))
        return a

    # ---- feeds -------------------------------------------------------------------------------

    def on_act(self, actor_id: str, identity: bytes, t_recv: float) -> None:
        with self._lock:
            self._actor(actor_id).last_act = time.monotonic()
            self._pending_acts.setdefault(identity, deque(maxlen=64)).append((actor_id, t_recv))

    def on_reply(self, identity: bytes) -> None:
        """An act reply (or error) for ``identity`` leaves: its oldest pending request is done."""
        now = time.perf_counter()
        with self._lock:
            q = self._pending_acts.get(identity)
            if not q:
                return
            actor_id, t_recv = q.popleft()
            ms = (now - t_recv) * 1000.0
            a = self._actor(actor_id)
            a.latencies_ms.append(ms)
            a.latency_hist.add(ms)
            self._run.add(ms)
            self._period.add(ms)

    def act_latency(self) -> dict:
        """Over all actors and the whole run: ``act_p50_ms``, ``act_p90_ms``, ``act_p99_ms``,
        ``act_max_ms``, ``act_mean_ms`` (None before the first act) and ``acts_timed``."""
        with self._lock:
            return self._run.summary("act")

    def act_histograms(self) -> dict:
        """The whole run's histograms (``all`` and per actor id) as JSON (``status.json``)."""
        with self._lock:
            out = {"all": self._run.to_dict()}
            out.update({name: a.latency_hist.to_dict() for name, a in self._actors.items() if a.latency_hist.n})
            return out

    def take_period(self) -> dict:
        """``act_p50_ms_recent`` and ``act_p99_ms_recent`` over the acts since the last call
        (None when there were none), ``acts_recent`` their number; starts a new period."""
        with self._lock:
            h, self._period = self._period, LatencyHistogram()
        return {"act_p50_ms_recent": h.quantile(0.5), "act_p99_ms_recent": h.quantile(0.99), "acts_recent": h.n}

    def on_records(self, batch, keep: np.ndarray) -> None:
        """New records of ``batch.actor_id`` (``keep``: those ingest stored)."""
        a = batch.arrays
        keep = np.asarray(keep, bool)
        if not keep.any():
            return
        is_last = np.asarray(a["is_last"], bool)
        steps = keep & ~is_last
        ends = steps & (np.asarray(a["terminated"], bool) | np.asarray(a["truncated"], bool))
        now = time.monotonic()
        with self._lock:
            s = self._actor(batch.actor_id)
            s.steps += int(steps.sum())
            s.last_records = now
            s.rate.append((now, s.steps))
            if steps.any():
                s.version = max(s.version, int(np.asarray(a["policy_version"])[steps].max()))
            episodes = np.asarray(a["episode"])
            intervened = np.asarray(a["intervened"], bool)
            success = np.asarray(a["success"], bool)
            for i in np.flatnonzero(steps):
                ep = int(episodes[i])
                s.open_intervened[ep] = s.open_intervened.get(ep, False) or bool(intervened[i])
                if ends[i]:
                    s.outcomes.append((bool(success[i]), s.open_intervened.pop(ep)))
                    s.episodes += 1
            while len(s.open_intervened) > 64:  # episodes that never ended (dropped)
                s.open_intervened.pop(next(iter(s.open_intervened)))

    # ---- reads -------------------------------------------------------------------------------

    def rows(self, *, peers: dict, peer_timeout_s: float, version: int,
             received: dict[str, int], acked: dict[str, int]) -> list[dict]:
        """One dict per actor ever seen (connected or not), sorted by actor id.

        ``peers``: actor id -> seconds since the learner last heard from it (absent: the actor
        said bye or never connected)."""
        now = time.monotonic()
        out = []
        with self._lock:
            names = sorted(set(self._actors) | set(peers))
            for name in names:
                s = self._actors.get(name) or _PerActor()
                silent = peers.get(name)
                connected = silent is not None and silent < peer_timeout_s
                rate = 0.0
                if connected and len(s.rate) >= 2:
                    recent = [(t, n) for t, n in s.rate if now - t <= 10.0] or list(s.rate)[-2:]
                    (t0, n0), (t1, n1) = recent[0], recent[-1]
                    span = max(now - t0, 1e-3) if now - t1 < 5.0 else max(t1 - t0, 1e-3)
                    rate = (n1 - n0) / span if now - t1 < 5.0 else 0.0
                lat = float(np.median(s.latencies_ms)) if s.latencies_ms else float("nan")
                p99 = float(np.percentile(s.latencies_ms, 99)) if s.latencies_ms else float("nan")
                outcomes = list(s.outcomes)
                out.append({
                    "actor": name,
                    "connected": connected,
                    "silent_s": None if silent is None else round(float(silent), 1),
                    "mode": "remote" if s.last_act and now - s.last_act < REMOTE_WITHIN_S else "local",
                    "steps": s.steps,
                    "steps_per_s": round(rate, 2),
                    "act_p50_ms": None if lat != lat else round(lat, 2),
                    "act_p99_ms": None if p99 != p99 else round(p99, 2),
                    "acts": s.latency_hist.n,
                    "act_p50_ms_run": s.latency_hist.quantile(0.5),
                    "act_p99_ms_run": s.latency_hist.quantile(0.99),
                    "unacked": max(0, received.get(name, -1) - acked.get(name, -1)),
                    "version": s.version,
                    "version_lag": None if s.version < 0 else max(0, version - s.version),
                    "episodes": s.episodes,
                    "window": len(outcomes),
                    "interventions": sum(1 for _, i in outcomes if i),
                    "success": (sum(1 for ok, _ in outcomes if ok) / len(outcomes)) if outcomes else None,
                })
        return out
