"""An actor's session as :class:`learner.service.LearnerService` and its handshake
(:mod:`learner.handshake`) keep it, in a module of its own so that both import it down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Peer:
    actor_id: str
    last_seen: float
    #: the actor process's random instance token from its hello ("" when it sent none): a
    #: retried hello of the same process may take over its own live session
    instance: str = ""
    #: this session's act token (the routing id of its act socket)
    token: bytes = b""
