"""When each actor's next act request is due: the inference server's forecast for batching.

An actor in a closed loop (a simulator, or a robot stepping a chunk) sends its next request a
*think time* after its last reply: the time it took to execute the chunk. Closed-loop simulated
actors think for about the same time, so requests that a plain batching window of a few ms
would serve one or two at a time arrive within tens of ms of one another. The server
(:class:`learner.inference.InferenceServer`, ``batch_due_ms``) uses this forecast to linger for
an actor whose next request is due (its last reply plus its last think time) within that many
ms of the batch's first request, and not for one that is not due, or is overdue by more than a
quarter of its think time (an actor resetting its episode, or gone). Served together, the
actors stay in step: each forward serves all of them, not one or two.

An actor is keyed by its routing identity. Only what the server saw is used: the time a reply
went out and the time the next request arrived (``ActRequest.t_recv``).
"""

from __future__ import annotations

#: an actor overdue by more than this share of its think time is not waited for
LATE_SHARE = 0.25
#: ... nor by more than this (s), whatever its think time
LATE_MAX_S = 0.05
#: an actor that has not asked for this long after its reply (s) is forgotten
FORGET_S = 60.0
#: identities remembered at most (the oldest replies are forgotten first)
MAX_ACTORS = 4096


class Arrivals:
    """Each actor's last reply time and last think time; :meth:`expected` says how long to
    wait for the absent ones."""

    def __init__(self, max_actors: int = MAX_ACTORS):
        self.max_actors = max_actors
        #: identity -> perf_counter when its last reply went out
        self.replied_at: dict[bytes, float] = {}
        #: identity -> seconds from its last reply to its next request
        self.think_s: dict[bytes, float] = {}

    def arrived(self, identity: bytes, t_recv: float) -> None:
        """A request from ``identity`` arrived at ``t_recv``: its think time is since its reply."""
        t = self.replied_at.pop(identity, None)
        if t is not None and t_recv >= t:
            self.think_s[identity] = t_recv - t

    def replied(self, identity: bytes, t: float) -> None:
        """A reply went to ``identity`` at ``t``."""
        self.replied_at[identity] = t
        if len(self.replied_at) > self.max_actors:  # (dicts keep insertion order: oldest first)
            for k in list(self.replied_at)[: len(self.replied_at) - self.max_actors]:
                del self.replied_at[k]
                self.think_s.pop(k, None)

    def expected(self, now: float, limit: float) -> float | None:
        """The time to wait until (perf_counter) for the actors whose next request is due by
        ``limit`` and not overdue at ``now``, at most ``limit``; None when none is expected.
        Actors with a request already taken have no pending reply and are not counted."""
        until, stale = None, None
        think = self.think_s
        for ident, t in self.replied_at.items():
            th = think.get(ident)
            if th is None or t < now - FORGET_S:
                if t < now - FORGET_S:
                    stale = (stale or []) + [ident]
                continue
            due = t + th
            if due > limit:
                continue
            late = due + min(LATE_MAX_S, LATE_SHARE * th)
            if late < now:
                continue
            end = min(late, limit)
            if until is None or end > until:
                until = end
        for ident in stale or ():  # (no reply for FORGET_S: a vanished actor)
            del self.replied_at[ident]
            self.think_s.pop(ident, None)
        return until
