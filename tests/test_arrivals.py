"""learner/arrivals.py and the server's ``batch_due_ms``: closed-loop actors whose think times
differ by tens of ms are served one or two at a time by a plain window, and together, in step,
when the server lingers for the actors it expects; an actor that stops asking (an episode
reset) is waited for only briefly, and never again at its old pace."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from agents.base import ActionChunk
from learner.act_intake import ActRequest
from learner.arrivals import FORGET_S, LATE_MAX_S, Arrivals
from learner.inference import InferenceServer


def test_expected_counts_only_actors_due_by_the_limit_and_not_overdue():
    a = Arrivals()
    a.replied(b"x", 0.0)
    assert a.expected(0.0, 1.0) is None  # no think time yet
    a.arrived(b"x", 0.1)  # thought 0.1 s
    a.replied(b"x", 1.0)  # due at 1.1
    assert a.expected(1.0, 1.2) == 1.1 + 0.025  # a quarter of its think time late at most
    assert a.expected(1.0, 1.05) is None  # due after the limit
    assert a.expected(1.2, 1.3) is None  # overdue by more than it may be
    a.arrived(b"x", 1.11)
    assert a.expected(1.11, 2.0) is None  # its request came: nothing pending
    a.arrived(b"y", 5.0)  # a request with no reply before it: no think time
    assert a.think_s == {b"x": a.think_s[b"x"]}
    a.replied(b"x", 2.0)
    a.replied(b"z", 2.0)
    a.arrived(b"z", 3.0)  # thought 1 s
    a.replied(b"z", 3.0)
    # a long thinker is late by LATE_MAX_S at most; the expected one furthest out sets the time
    assert a.expected(3.0, 10.0) == 4.0 + LATE_MAX_S
    a.expected(3.0 + FORGET_S + 1, 1e9)  # no reply answered for a minute: forgotten
    assert a.replied_at == {} and a.think_s == {}


class Sleeps:
    """A policy whose act takes 5 ms whatever the batch (a GPU forward, roughly)."""

    def act(self, obs, *, deterministic=False):
        time.sleep(0.005)
        return ActionChunk(torch.zeros(obs["observation.state"].shape[0], 2, 2))


def closed_loop(due_ms: float, thinks: list[float], seconds: float, pause: dict | None = None):
    """Actors that each ask, wait for the reply and think for their time, for ``seconds``;
    ``pause`` {actor: (after s, for s)} makes one think longer once. Returns the server and
    each actor's reply waits (s) by the time it asked."""
    events = [threading.Event() for _ in thinks]
    inf = InferenceServer(Sleeps(), reply=lambda ident, frames: events[int(ident)].set(),
                          active_actors=lambda: len(thinks), device=torch.device("cpu"), max_batch=16,
                          batch_window_ms=2.0, batch_due_ms=due_ms)
    stop, waits = threading.Event(), {i: [] for i in range(len(thinks))}
    t_start = time.perf_counter()

    def actor(i):
        req, paused = 0, False
        while not stop.is_set():
            events[i].clear()
            req += 1
            t = time.perf_counter()
            inf.submit(ActRequest(identity=b"%d" % i, req_id=req, deterministic=True, tasks=["t"],
                                  arrays={"observation.state": np.zeros((1, 3), np.float32)}))
            if not events[i].wait(5):
                return
            waits[i].append((t - t_start, time.perf_counter() - t))
            think = thinks[i]
            if pause and i in pause and not paused and t - t_start > pause[i][0]:
                think, paused = pause[i][1], True
            time.sleep(think)

    inf.start()
    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(len(thinks))]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join(5)
    inf.stop()
    inf.join(5)
    return inf, waits


THINKS = [0.030, 0.045, 0.060, 0.075]  # a spread of 45 ms


def test_lingering_for_due_actors_serves_them_together():
    plain, _ = closed_loop(0.0, THINKS, 2.0)
    due, _ = closed_loop(100.0, THINKS, 2.0)
    m_plain = np.mean(plain.batch_sizes[5:])
    m_due = np.mean(due.batch_sizes[5:])
    assert m_plain < 2.0, plain.batch_sizes  # a 2-ms window: mostly one at a time
    assert m_due > 3.0, due.batch_sizes  # in step: nearly every forward serves all four
    assert due.batches < plain.batches / 1.8  # far fewer forwards for the same actors


def test_an_actor_that_stops_asking_holds_the_others_up_once_and_briefly():
    # actor 3 thinks for 1 s once, 1 s in (its episode resets)
    inf, waits = closed_loop(100.0, THINKS, 3.0, pause={3: (1.0, 1.0)})
    during = [w for i in range(3) for t, w in waits[i] if 1.3 < t < 1.9]
    assert len(during) >= 10  # the others went on being served while it was away
    # it was due at its old pace and overdue past a quarter of its 75 ms: at most ~19 ms more;
    # after that it is not expected (due at 1 s), and each wait is the others' spread at most
    assert max(during) < 0.075 + 0.05, sorted(during)[-5:]
    after = [w for i in range(4) for t, w in waits[i] if t > 2.4]
    assert after and np.mean(inf.batch_sizes[-10:]) > 2.5  # back in step once it returned
