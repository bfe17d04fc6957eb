"""The Tandem robot driver protocol: message schemas, errors, and the helpers both ends
share (observation <-> arrays, the spec message, JSON-safe info, endpoint security).

The protocol (ZMQ, DEALER client -> ROUTER driver; the wire codec of :mod:`data.core.codec`
with the schemas in :data:`DRIVER_SCHEMAS`; never pickle) has four verbs plus a handshake
and a heartbeat::

    describe   {client_id, req, driver_protocol}       -> spec {spec (JSON), driver_id}
                                                          + arrays action_low, action_high
    hello      {client_id, req, driver_protocol}       -> spec, and this client takes control
    observe    {client_id, req}                        -> obs
    act        {client_id, req, seq} + array action    -> obs (after one control step)
    reset      {client_id, req, seed, options (JSON)}  -> obs
    stop       {client_id, req, reason}                -> stopped
    heartbeat  {client_id, req, t}                     -> heartbeat_ack {t, stopped}
    bye        {client_id, req}                        -> stopped

    obs = {req, seq, reward, terminated, truncated, stopped, info (JSON), task}
          + arrays "observation.state", "observation.images.<cam>"
    error = {req, code, message}

Rules the driver (:mod:`envs.robot.driver`) enforces:

* one controlling client at a time (the first ``hello``; another gets ``busy`` until the
  controller says ``bye`` or its heartbeat lapses); ``describe`` answers anyone without
  taking control (the client env takes control on its first ``reset``, so a process that
  only builds the env to read its spaces never holds the robot);
* if nothing (heartbeat or command) arrives from the controller for ``heartbeat_timeout``
  seconds, the robot is **stopped** and stays stopped until the next ``reset``;
* ``act`` carries a sequence number; a retried ``act`` with the number already executed
  gets the cached reply instead of moving the robot twice.

Endpoints that are not loopback need CURVE keys on both ends (or an explicit
``insecure``); the loopback test and the socket setup are :mod:`data.core.security`'s.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import gymnasium as gym
import msgpack
import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK, MessageSchema
from data.core.security import is_loopback

DRIVER_PROTOCOL_VERSION = 1
DEFAULT_PORT = 5590
MAX_DRIVER_MESSAGE_BYTES = 64 * 1024 * 1024

DRIVER_SCHEMAS: dict[str, MessageSchema] = {
    # client -> driver
    "describe": MessageSchema({"client_id": str, "req": int, "driver_protocol": int}),
    "hello": MessageSchema({"client_id": str, "req": int, "driver_protocol": int}),
    "observe": MessageSchema({"client_id": str, "req": int}),
    "act": MessageSchema({"client_id": str, "req": int, "seq": int}, ("action",)),
    "reset": MessageSchema({"client_id": str, "req": int, "seed": int, "options": str}),
    "stop": MessageSchema({"client_id": str, "req": int, "reason": str}),
    "heartbeat": MessageSchema({"client_id": str, "req": int, "t": float}),
    "bye": MessageSchema({"client_id": str, "req": int}),
    # driver -> client
    "spec": MessageSchema({"req": int, "driver_id": str, "spec": str, "driver_protocol": int},
                          ("action_low", "action_high")),
    "obs": MessageSchema(
        {"req": int, "seq": int, "reward": float, "terminated": bool, "truncated": bool,
         "stopped": bool, "info": str, "task": str},
        (OBS_STATE,),
    ),
    "heartbeat_ack": MessageSchema({"req": int, "t": float, "stopped": bool}),
    "stopped": MessageSchema({"req": int, "reason": str}),
    "error": MessageSchema({"req": int, "code": str, "message": str}),
}

#: message types only a driver sends
DRIVER_TO_CLIENT = ("spec", "obs", "heartbeat_ack", "stopped", "error")


class RobotError(RuntimeError):
    """The driver answered with an error (``code`` says which)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"robot driver error [{code}]: {message}")
        self.code = code


class RobotStopped(RobotError):
    """The driver refuses to move: the robot is stopped (a stop, a lapsed heartbeat, a
    failed step). ``reset()`` re-arms it."""


class RobotLinkLost(RuntimeError):
    """The driver stopped answering (heartbeat or request timeout). The robot has been
    told to stop (best effort; the driver also stops it on its own when our heartbeat
    lapses). ``reset()`` reconnects."""


def jsonable(obj: Any, depth: int = 0) -> Any:
    """Keep the JSON-safe part of an info dict (numbers, bools, strings, small arrays)."""
    if depth > 4:
        return None
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, str):
        return obj
    if isinstance(obj, np.ndarray) and obj.size <= 64 and obj.dtype.kind in "biuf":
        return obj.tolist()
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            j = jsonable(v, depth + 1)
            if j is not None or v is None:
                out[str(k)] = j
        return out
    if isinstance(obj, (list, tuple)) and len(obj) <= 64:
        return [jsonable(v, depth + 1) for v in obj]
    return None


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://host:port`` endpoint; ``ipc://`` and ``inproc://`` endpoints
    never leave the machine and count as ``localhost``."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return "localhost"
    if not endpoint.startswith("tcp://"):
        return endpoint  # another transport: never taken for loopback
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def endpoint_is_loopback(endpoint: str) -> bool:
    """True for tcp://127.x / localhost / ::1 and for ipc:// / inproc:// endpoints
    (:func:`data.core.security.is_loopback` on :func:`endpoint_host`)."""
    return is_loopback(endpoint_host(endpoint))


def spec_message(env: gym.Env) -> dict:
    """What a driver tells its clients about the robot (JSON-able; the ``spec`` field of
    the ``spec`` message). Not :func:`envs.spec.spec_from_env`, which reads a
    :class:`data.core.spec.EnvSpec` off an env."""
    space = env.observation_space
    cams = {k[len(OBS_IMAGE_PREFIX):]: list(s.shape) for k, s in space.spaces.items()
            if k.startswith(OBS_IMAGE_PREFIX)}
    u = env.unwrapped
    steps = getattr(u, "default_max_episode_steps", None)
    if not steps and env.spec is not None and env.spec.max_episode_steps:
        steps = env.spec.max_episode_steps
    return {
        "state_dim": int(space.spaces[OBS_STATE].shape[0]),
        "cameras": cams,
        "has_task": TASK in space.spaces,
        "action_dim": int(env.action_space.shape[0]),
        "default_max_episode_steps": int(steps or 0),
        "ee_pos_index": list(getattr(u, "ee_pos_index", ())),
        "action_pos_index": list(getattr(u, "action_pos_index", ())),
        "control_hz": float(env.metadata.get("render_fps", 0) or 0),
        "name": str(getattr(env.spec, "id", "") or type(u).__name__),
    }


def obs_from_message(msg, space: gym.spaces.Dict) -> dict[str, Any]:
    """An ``obs`` message -> an observation dict, checked against ``space`` (RobotError
    ``bad_obs`` on a missing entry or a wrong shape / dtype)."""
    obs: dict[str, Any] = {k: np.array(v) for k, v in msg.arrays.items()}
    if TASK in space.spaces:
        obs[TASK] = msg["task"]
    for k, sp in space.spaces.items():
        if k != TASK and (k not in obs or obs[k].shape != sp.shape or obs[k].dtype != sp.dtype):
            raise RobotError("bad_obs", f"{k}: expected {sp.dtype}{sp.shape}, got "
                                        f"{obs[k].dtype}{obs[k].shape}" if k in obs else f"{k} missing")
    return obs


def obs_to_arrays(obs: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], str]:
    """An observation dict -> (the arrays of an ``obs`` message, its ``task`` field)."""
    arrays = {k: np.asarray(v) for k, v in obs.items() if k != TASK}
    return arrays, str(obs.get(TASK, ""))


def with_req(frames: Sequence[Any], req: int) -> list[Any]:
    """Encoded message frames with the header's ``req`` replaced (a cached reply resent
    to a retried request)."""
    header = msgpack.unpackb(bytes(memoryview(frames[0])), raw=False)
    header["req"] = req
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]
