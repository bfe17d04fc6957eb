"""The handshake of :class:`learner.service.LearnerService`: a ``hello`` becomes a session
(``welcome``) or a named refusal (see that module's docstring: actor ids owned by one session
or bound to a CURVE key, resend positions checked). A welcome always encodes: an actor whose
stored position has left the wire's ranges is refused with ``bad_state`` instead."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from data.core.codec import encode
from data.core.schema import ACT_TOKEN_BYTES, MAX_SEQ
from learner.act_channel import is_act_token
from learner.peers import Peer

log = logging.getLogger("tandem.learner.service")


def on_hello(svc: Any, identity: bytes, msg, user_id: str | None = None) -> None:
    """``svc``: the :class:`learner.service.LearnerService` (not imported: it imports this module)."""
    actor_id = msg["actor_id"]
    if not actor_id or len(actor_id) > 128:
        svc._error(identity, "bad_hello", "actor_id must be 1-128 characters")
        return
    if is_act_token(identity):  # replies to such ids are taken for the act socket's
        svc._error(identity, "bad_hello", f"a routing id of {ACT_TOKEN_BYTES} bytes not "
                   "starting with 0 is reserved for act sockets; leave the main socket's "
                   "routing id unset")
        return
    if svc.key_ids is not None:
        owner = svc.key_ids.get(user_id or "")
        if owner != actor_id:
            svc._error(identity, "identity_mismatch",
                       f"this CURVE key is not actor {actor_id!r}'s (it belongs to "
                       f"{owner!r}): each actor id is bound to its key in the "
                       "authorised-keys folder")
            return
    if msg["config_hash"] != svc.config_hash:
        svc._error(identity, "config_mismatch",
                   f"actor {actor_id!r} has config hash {msg['config_hash']}, learner has "
                   f"{svc.config_hash}: env, policy or chunk settings differ")
        return
    known = svc.ingest.knows_actor(actor_id) or any(p.actor_id == actor_id for p in svc.peers.values())
    if not known and svc.ingest.actor_count() >= svc.max_actor_ids:
        svc._error(identity, "too_many_actors",
                   f"this learner keeps state for at most {svc.max_actor_ids} actor ids "
                   "(transport.max_actor_ids) and knows that many: reuse an actor id")
        return
    now = time.monotonic()
    if len(svc.peers) > 256:  # forget silent sessions: a flood of hellos stays bounded
        svc.peers = {i: p for i, p in svc.peers.items() if now - p.last_seen < svc.peer_timeout_s}
        svc.act_sessions = {p.token: p for p in svc.peers.values() if p.token}
    holders = [i for i, p in svc.peers.items() if p.actor_id == actor_id and i != identity]
    instance = msg.get("instance")
    instance = instance if isinstance(instance, str) and 0 < len(instance) <= 64 else ""
    live = [i for i in holders if now - svc.peers[i].last_seen < svc.peer_timeout_s
            and not (instance and svc.peers[i].instance == instance)]
    if live and svc.key_ids is None:
        svc._error(identity, "actor_id_in_use",
                   f"actor id {actor_id!r} belongs to a live session (until it is silent for "
                   f"{svc.peer_timeout_s:.0f}s); retry later, or give this actor its own id")
        return
    resend_from = msg["resend_from"]
    acked, next_episode = svc.ingest.actor_position(actor_id)
    if next_episode > MAX_SEQ or acked > MAX_SEQ:  # a state kept from before the bounds
        svc._error(identity, "bad_state", f"actor {actor_id!r}: its stored episode ids or sequence "
                   f"numbers ({next_episode - 1}, {acked}) reached the top of the wire's range "
                   f"({MAX_SEQ}); give this actor a new id")
        return
    if resend_from > acked + 1 and svc.ingest.knows_acks(actor_id):
        svc._error(identity, "bad_resend",
                   f"actor {actor_id!r} resends from seq {resend_from}, but this learner "
                   f"acknowledged its records only up to {acked}; records in between would "
                   "be skipped. If the learner's run_dir was replaced, clear the actor's spool")
        return
    # A reconnecting actor gets a new identity: forget the old (stale, or same-key) one.
    for ident in holders:
        svc.act_sessions.pop(svc.peers.pop(ident).token, None)
    old = svc.peers.get(identity)
    if old is not None:  # a second hello on the same connection: a new session token
        svc.act_sessions.pop(old.token, None)
    token = b"\x01" + os.urandom(ACT_TOKEN_BYTES - 1)
    svc.peers[identity] = peer = Peer(actor_id, now, instance, token)
    svc.act_sessions[token] = peer
    ch = svc.act_channel
    act_port = ch.port if ch is not None and ch.claimed and not ch.closed else 0
    svc.ingest.resync(actor_id, resend_from)
    acked, next_episode = svc.ingest.actor_position(actor_id)
    log.info("actor %s connected (acked seq %d)", actor_id, acked)
    svc._send(identity, encode("welcome", {
        "learner_id": svc.learner_id, "acked_seq": acked,
        "received_seq": max(acked, svc.ingest.received.get(actor_id, -1)),
        "policy_version": svc.get_version(), "mode": svc.mode,
        "next_episode": next_episode, "spec": svc.spec.to_dict(), "jobs": svc.next_job is not None,
        "act_port": act_port, "act_token": token if act_port else b"",
    }))

