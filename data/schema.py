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
            "step" [N] int64
    fields  "actor_id" str, "first_seq" int, "last_seq" int, "tasks" [str]*N

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
}


@dataclass(frozen=True)
class MessageSchema:
    fields: dict[str, type] = field(default_factory=dict)
    arrays: tuple[str, ...] = ()


MESSAGE_SCHEMAS: dict[str, MessageSchema] = {
    # actor -> learner
    "hello": MessageSchema({"actor_id": str, "config_hash": str, "resend_from": int}),
    "act": MessageSchema({"req_id": int, "deterministic": bool, "tasks": list}, (OBS_STATE,)),
    "transitions": MessageSchema(
        {"actor_id": str, "first_seq": int, "last_seq": int, "tasks": list}, tuple(STEP_ARRAYS)
    ),
    "ping": MessageSchema({"t": float}),
    "get_weights": MessageSchema({"have_version": int}),
    "bye": MessageSchema({}),
    # learner -> actor
    # acked_seq: every record <= it is durable (the actor may delete it from its spool);
    # received_seq: every record <= it has arrived (the actor need not send it again
    # on this connection). received_seq >= acked_seq.
    "welcome": MessageSchema(
        {"learner_id": str, "acked_seq": int, "received_seq": int, "policy_version": int,
         "mode": str, "next_episode": int}
    ),
    "act_reply": MessageSchema({"req_id": int, "policy_version": int}, ("actions",)),
    "ack": MessageSchema({"acked_seq": int, "received_seq": int, "policy_version": int}),
    "pong": MessageSchema({"t": float, "policy_version": int}),
    "weights": MessageSchema({"policy_version": int}),
    "error": MessageSchema({"code": str, "message": str}),
}


def image_keys(obs_keys) -> list[str]:
    """Camera keys of an observation dict or array map, in sorted order."""
    return sorted(k for k in obs_keys if k.startswith(OBS_IMAGE_PREFIX))
