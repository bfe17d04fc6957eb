"""The one way an ``act`` request reaches the inference server: decoded and validated once,
into the :class:`ActRequest` that :class:`learner.inference.InferenceServer` serves.

A learner has two act paths (:mod:`learner.service`: the socket thread on the main ROUTER;
:mod:`learner.act_channel`: the inference thread on the act socket), and both go through
here: :func:`decode_request` (the codec's limits and schema; a value out of a field's range
is ``bad_request``, anything else malformed ``bad_message``) and :meth:`ActIntake.validate`
(evaluation finished, the observation's layout and values, :func:`learner.wire_guard.check_act_obs`;
the optional real-time-chunking arrays ``rtc.prefix``, ``rtc.pending``, ``rtc.delay``,
:func:`learner.wire_guard.check_rtc`, refused with ``bad_request`` naming the problem). The
act socket reads whole messages with :meth:`ActIntake.read` (decode, only ``act``, validate).
A refusal is returned as ``(error code, message)``; each path sends it as an ``error`` reply
its own way (counted as a rejection, except ``finished``). Nothing here runs a forward pass:
inference stays on the inference thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.core.codec import CodecError, FieldRangeError, Message, decode
from data.core.schema import OBS_STATE
from learner.wire_guard import check_act_obs, check_rtc, split_rtc

#: (error code, message) of a request that is not served
Refusal = tuple[str, str]


@dataclass
class ActRequest:
    identity: bytes
    req_id: int
    deterministic: bool
    arrays: dict[str, np.ndarray]
    tasks: list[str]
    t_recv: float = field(default_factory=time.perf_counter)
    #: the session's actor id ("" when the submitter did not know it)
    actor_id: str = ""
    #: real-time chunking: the request's checked RTC arrays (data.core.schema.RTC_ARRAYS), or None
    rtc: dict[str, np.ndarray] | None = None

    @property
    def n(self) -> int:
        return int(self.arrays[OBS_STATE].shape[0])


def decode_request(frames: list, max_bytes: int) -> Message | Refusal:
    """The message of ``frames`` (the codec's checks, ``max_bytes`` at most), or a refusal."""
    try:
        return decode(frames, max_bytes=max_bytes)
    except CodecError as exc:
        return ("bad_request" if isinstance(exc, FieldRangeError) else "bad_message"), str(exc)


class ActIntake:
    """Act requests of one :class:`learner.service.LearnerService` (``service``, not imported:
    it imports this module): its spec, mode, ``finished``, ``rtc_chunk``, message limit and
    counters (``acts`` counts every request that passed)."""

    def __init__(self, service: Any):
        self.service = service

    def read(self, identity: bytes, frames: list, actor_id: str, *, touch: Any = None) -> ActRequest | Refusal:
        """A whole message of the act socket: decoded, only ``act``, then :meth:`validate`.
        ``touch``: the session, whose ``last_seen`` an act request renews."""
        msg = decode_request(frames, self.service.max_message_bytes)
        if type(msg) is tuple:
            return msg
        if msg.type != "act":
            return ("unexpected_type", f"{msg.type!r} is not a request of the act socket (only "
                    "'act'; the rest go to the main socket)")
        if touch is not None:
            touch.last_seen = time.monotonic()
        return self.validate(identity, msg, actor_id)

    def validate(self, identity: bytes, msg: Message, actor_id: str) -> ActRequest | Refusal:
        """A decoded ``act`` request -> the request to serve, or why it must not be served."""
        svc = self.service
        if svc.finished:
            return "finished", "evaluation is done"
        obs, rtc = split_rtc(msg.arrays)
        checked = Message(msg.type, msg.fields, obs, None) if rtc else msg  # RTC: the observation alone
        err = check_act_obs(checked, svc.spec)
        if err:
            return "bad_observation", err
        err = rtc and check_rtc(rtc, len(msg["tasks"]), svc.rtc_chunk, svc.spec.action_dim)
        if err:
            return "bad_request", err
        with svc._count_lock:
            svc.counters["acts"] += 1
        return ActRequest(identity, msg["req_id"], bool(msg["deterministic"]) or svc.mode == "eval",
                          obs, msg["tasks"], actor_id=actor_id, rtc=rtc or None)
