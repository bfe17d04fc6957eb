"""Wire schema: message types, their required fields, and the transition layout.

Observation dicts everywhere in Tandem use LeRobot-style keys::

    "observation.state"            float32 [S]
    "observation.images.<camera>"  uint8   [H, W, 3]
    "task"                         str     (instruction; may be "")

A transition batch (message ``transitions``) carries N steps of one actor, stacked:

    arrays  "observation.state" [N,S], "observation.images.<cam>" [N,H,W,3],
            "action" [N,A] float32, "reward" [N] float32, "terminated" [N] bool,
            "truncated" [N] bool, "intervened" [N] bool, "is_last" [N] bool,
            "success" [N] bool, "policy_version" [N] int64, "episode" [N] int64,
            "step" [N] int64, "chunk_start" [N] bool, "chunk_index" [N] int64,
            "group_id" [N] int64,
            "extra.<name>" [N, ...] (one per policy extra the learner declared)
    fields  "actor_id" str, "first_seq" int, "last_seq" int, "tasks" [str]*N

``chunk_start`` marks the step whose observation the policy was asked about and whose
executed action is the policy's, and ``chunk_index`` is the step's position in the executed
action chunk (0 at a chunk start). A human-driven step has ``chunk_start`` False and carries
the interrupted chunk's extras; an ``is_last`` record has zero extras.
``group_id`` is the group of the learner job the episode ran (-1: no job).
With real-time chunking (actor ``chunk.rtc``) the next chunk is asked for while the current
one runs and takes over when its reply arrives, ``d`` steps after the observation it was
asked about: ``chunk_start`` then marks the first step that executes an action of the new
chunk, with ``chunk_index`` = ``d`` (the delay, its position in that chunk); the steps before
it executed the previous chunk's actions and carry that chunk's index, extras and version.
Every record's ``action`` is the action that ran.
Policy extras (``log_prob``, ``value``, PI0's noise, OFT's action tokens, ...) come with the
act reply as ``extra.<name>`` arrays [B, ...]; every step of a chunk carries its chunk's
extras. Their names, dtypes and shapes are declared once by the policy
(:attr:`agents.base.Policy.extras_spec`), sent to actors in the ``welcome`` (``spec``) and
checked on ingest like every other array.

Step ``t`` of an episode holds ``obs_t``, the action taken in it and the reward,
termination and truncation that followed. After the step that ends an episode the actor
sends one more record with ``is_last=True`` holding the final observation (action zeros,
reward 0), RLDS style, so the next observation is always reached by index and the final
observation of a truncated episode is kept for bootstrapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROTOCOL_VERSION = 1

OBS_STATE = "observation.state"
OBS_IMAGE_PREFIX = "observation.images."
TASK = "task"

# Per-step arrays of a transition batch besides the observation ones: name -> dtype.
STEP_ARRAYS: dict[str, str] = {
    "action": "float32",
    "reward": "float32",
    "terminated": "bool",
    "truncated": "bool",
    "intervened": "bool",
    "is_last": "bool",
    "success": "bool",
    "policy_version": "int64",
    "episode": "int64",
    "step": "int64",
    "chunk_start": "bool",
    "chunk_index": "int64",
    "group_id": "int64",
}

#: values of the per-step arrays that a record may leave out (a step outside any chunk or job)
STEP_DEFAULTS: dict[str, object] = {"chunk_start": True, "chunk_index": 0, "group_id": -1}

#: prefix of policy extras in act replies, records, replay batches and the dataset
EXTRA_PREFIX = "extra."


#: the largest sequence number, episode id, request id or version on the wire: exact in a
#: float64 and far from the int64 limit, so ``seq + n`` never overflows numpy's int64
MAX_SEQ = 2**53 - 1
#: default bounds of a header int without its own entry in :data:`FIELD_BOUNDS` (int64)
INT64_BOUNDS = (-(2**63), 2**63 - 1)
#: the most items a header list (``tasks``) may hold: one per record of a batch
MAX_LIST_LEN = 65536
#: optional arrays of an ``act`` request asking for real-time chunking (all three or none):
#: the not yet executed actions of the current chunk [B, H, A] float32 (its first ``pending``
#: rows real, H the policy's chunk), the inference delay in steps [B] int64 (0..pending) and
#: ``pending`` [B] int64 (0..H; 0: that row without RTC); checked by the learner
#: (``learner.wire_guard.check_rtc``)
RTC_PREFIX, RTC_DELAY, RTC_PENDING = "rtc.prefix", "rtc.delay", "rtc.pending"
RTC_ARRAYS = (RTC_PREFIX, RTC_DELAY, RTC_PENDING)

#: the most records of one ``transitions`` or ``act`` message
MAX_BATCH = 4096
#: the most bytes of a header bytes field (``act_token``)
MAX_BYTES_FIELD = 1024
#: length of a session's act token; its first byte is never 0 (ZMQ reserves routing ids
#: starting with a zero byte for the ones it makes up), which also tells a reply to an act
#: token from one to the main ROUTER's identities
ACT_TOKEN_BYTES = 16

#: inclusive bounds of header int fields, by name (the same name means the same quantity in
#: every message type); the codec refuses a value outside them on decode. Where a value is
#: followed by another one (a sequence number by the next, an episode id by the welcome's
#: ``next_episode``), the accepted range stops one short of the field the successor goes
#: into: nothing accepted can make a later message unencodable.
FIELD_BOUNDS: dict[str, tuple[int, int]] = {
    "resend_from": (0, MAX_SEQ), "first_seq": (0, MAX_SEQ - 1), "last_seq": (0, MAX_SEQ - 1),
    "acked_seq": (-1, MAX_SEQ), "received_seq": (-1, MAX_SEQ), "req_id": (0, MAX_SEQ),
    "have_version": (-1, MAX_SEQ), "policy_version": (0, MAX_SEQ), "episode": (0, MAX_SEQ - 1),
    "next_episode": (0, MAX_SEQ), "act_port": (0, 65535),
    "job_id": (0, 2**31 - 1), "task_id": (0, 2**31 - 1), "init_state": (0, 2**31 - 1),
    "seed": (0, 2**31 - 1), "group_id": (-1, 2**31 - 1),
}

#: inclusive bounds of the integer per-step arrays of a ``transitions`` message (an episode id
#: or step one short of the top: its successor, the welcome's ``next_episode`` or the
#: ``is_last`` record's step, stays in range)
STEP_BOUNDS: dict[str, tuple[int, int]] = {
    "policy_version": (0, MAX_SEQ), "episode": (0, MAX_SEQ - 1), "step": (0, 2**31 - 2),
    "chunk_index": (0, 2**31 - 1), "group_id": (-1, 2**31 - 1),
}


@dataclass(frozen=True)
class MessageSchema:
    """Required header fields (name -> Python type) and required arrays of a message type.

    ``bounds`` (int field -> inclusive range) turns on the value checks: int fields within
    their bounds (int64 when not listed), float fields finite, list fields at most
    :data:`MAX_LIST_LEN` items. Tandem's own messages all have them (from
    :data:`FIELD_BOUNDS`); another protocol on the codec (the robot driver) without bounds
    gets type checks only."""

    fields: dict[str, type] = field(default_factory=dict)
    arrays: tuple[str, ...] = ()
    bounds: dict[str, tuple[int, int]] | None = None


MESSAGE_SCHEMAS: dict[str, MessageSchema] = {
    # actor -> learner
    "hello": MessageSchema({"actor_id": str, "config_hash": str, "resend_from": int}),
    # arrays: the observation [B, ...], and optionally RTC_ARRAYS (real-time chunking)
    "act": MessageSchema({"req_id": int, "deterministic": bool, "tasks": list}, (OBS_STATE,)),
    "transitions": MessageSchema(
        {"actor_id": str, "first_seq": int, "last_seq": int, "tasks": list}, tuple(STEP_ARRAYS)
    ),
    "ping": MessageSchema({"t": float}),
    "get_weights": MessageSchema({"have_version": int}),
    "bye": MessageSchema({}),
    # ask for the next episode's job before resetting (only when the welcome says jobs=True)
    "get_job": MessageSchema({"episode": int}),
    # learner -> actor
    # acked_seq: every record <= it is durable (the actor may delete it from its spool);
    # received_seq: every record <= it has arrived (the actor need not send it again
    # on this connection). received_seq >= acked_seq.
    # act_port / act_token: the learner's act socket (0: none, send act here) and this
    # session's token, the routing id the actor's act socket must use (ACT_TOKEN_BYTES)
    "welcome": MessageSchema(
        {"learner_id": str, "acked_seq": int, "received_seq": int, "policy_version": int,
         "mode": str, "next_episode": int, "spec": dict, "jobs": bool, "act_port": int,
         "act_token": bytes}
    ),
    # actions [B, H, A] float32, plus "extra.<name>" [B, ...] arrays of the policy's extras
    "act_reply": MessageSchema({"req_id": int, "policy_version": int}, ("actions",)),
    # the next episode to run exactly: reset with this seed, task and initial state
    "job": MessageSchema({"episode": int, "job_id": int, "task_id": int, "init_state": int,
                          "seed": int, "group_id": int, "deterministic": bool}),
    "no_job": MessageSchema({"episode": int}),
    "ack": MessageSchema({"acked_seq": int, "received_seq": int, "policy_version": int}),
    # a transitions batch the learner refused (records first_seq..last_seq, consumed: the
    # following ack covers them); the actor keeps it as a dead letter and goes on
    "batch_rejected": MessageSchema({"first_seq": int, "last_seq": int, "code": str, "message": str}),
    "pong": MessageSchema({"t": float, "policy_version": int}),
    "weights": MessageSchema({"policy_version": int}),
    "error": MessageSchema({"code": str, "message": str}),
}


# every int field of Tandem's messages is bounded, by name
MESSAGE_SCHEMAS = {
    t: MessageSchema(s.fields, s.arrays, {k: FIELD_BOUNDS[k] for k, typ in s.fields.items() if typ is int})
    for t, s in MESSAGE_SCHEMAS.items()
}


def image_keys(obs_keys) -> list[str]:
    """Camera keys of an observation dict or array map, in sorted order."""
    return sorted(k for k in obs_keys if k.startswith(OBS_IMAGE_PREFIX))
