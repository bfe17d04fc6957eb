"""A robot reached through the Tandem driver protocol, as a gymnasium env.

The protocol (ZMQ, DEALER client -> ROUTER driver; the wire codec of :mod:`data.core.codec` with
the schemas in :data:`DRIVER_SCHEMAS`; never pickle) has four verbs plus a handshake and a
heartbeat::

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

Rules the driver (:mod:`envs.robot_driver`) enforces:

* one controlling client at a time (the first ``hello``; another gets ``busy`` until the
  controller says ``bye`` or its heartbeat lapses); ``describe`` answers anyone without
  taking control (the client env takes control on its first ``reset``, so a process that
  only builds the env to read its spaces never holds the robot);
* if nothing (heartbeat or command) arrives from the controller for ``heartbeat_timeout``
  seconds, the robot is **stopped** and stays stopped until the next ``reset``;
* ``act`` carries a sequence number; a retried ``act`` with the number already executed
  gets the cached reply instead of moving the robot twice.

The client's spaces come from the driver (``describe``), or from the config's ``spec``
(``state_dim``, ``action_dim``, ``cameras``, ``has_task``, optional ``action_low/high``,
``default_max_episode_steps``, ``ee_pos_index``, ``action_pos_index``): then nothing is
contacted before the first ``reset`` (a learner on another machine can build the env to
read its spec), and the driver's spec is checked against it at the handshake.

Client-side safety (this module): actions are clipped to the action space (and, through
:func:`envs.registry.make_env`, the config's ``safety`` block adds workspace bounds); a
background thread sends heartbeats on its own socket and, when the driver stops answering
for ``heartbeat_timeout``, marks the link lost: the next ``step`` sends a best-effort
``stop`` and raises :class:`RobotLinkLost`. ``reset`` re-handshakes, so an actor can
recover after the driver comes back.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Mapping

import gymnasium as gym
import numpy as np
import zmq
from gymnasium import spaces

from data.core.codec import CodecError, decode, encode
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK, MessageSchema
from envs.wrappers import TEXT_SPACE

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


def is_loopback(endpoint: str) -> bool:
    """True for tcp://127.x / localhost / ::1 and for ipc:// / inproc:// endpoints."""
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith(("ipc://", "inproc://"))
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def spec_from_env(env: gym.Env) -> dict:
    """What a driver tells its clients about the robot (JSON-able)."""
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


def obs_to_arrays(obs: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], str]:
    arrays = {k: np.asarray(v) for k, v in obs.items() if k != TASK}
    return arrays, str(obs.get(TASK, ""))


def _curve_setup(sock: zmq.Socket, *, server_public: str | None, client_key: str | None) -> None:
    """Client side of CURVE: ``server_public`` is the driver's public key file,
    ``client_key`` this client's secret key file (both made by ``zmq.auth``)."""
    if not server_public:
        return
    from zmq import auth as zauth

    spub, _ = zauth.load_certificate(server_public)
    if not client_key:
        raise ValueError("CURVE needs the client's key file too (curve_client_key)")
    cpub, csec = zauth.load_certificate(client_key)
    if csec is None:
        raise ValueError(f"{client_key} has no secret key")
    sock.curve_serverkey = spub
    sock.curve_publickey = cpub
    sock.curve_secretkey = csec


class _Heartbeat(threading.Thread):
    """Sends heartbeats on its own DEALER socket; sets ``lost`` when acks stop coming."""

    def __init__(self, ctx: zmq.Context, address: str, client_id: str, period: float, timeout: float,
                 curve: dict):
        super().__init__(daemon=True, name=f"robot-heartbeat-{client_id[:8]}")
        self.ctx, self.address, self.client_id = ctx, address, client_id
        self.period, self.timeout, self.curve = float(period), float(timeout), curve
        self.lost = threading.Event()
        self.halt = threading.Event()
        self.driver_stopped = False
        self.last_ack = time.monotonic()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        _curve_setup(sock, **self.curve)
        sock.connect(self.address)
        req = itertools.count(1)
        try:
            while not self.halt.is_set():
                sock.send_multipart(encode("heartbeat", {"client_id": self.client_id, "req": next(req),
                                                         "t": time.time()}, schemas=DRIVER_SCHEMAS),
                                    copy=False)
                deadline = time.monotonic() + self.period
                while (left := deadline - time.monotonic()) > 0 and not self.halt.is_set():
                    if sock.poll(int(left * 1000) + 1):
                        try:
                            msg = decode(sock.recv_multipart(copy=False), schemas=DRIVER_SCHEMAS)
                        except CodecError:
                            continue
                        if msg.type == "heartbeat_ack":
                            self.last_ack = time.monotonic()
                            self.driver_stopped = bool(msg["stopped"])
                if time.monotonic() - self.last_ack > self.timeout:
                    self.lost.set()
        finally:
            sock.close(0)


class RobotEnv(gym.Env):
    """Client env for a robot behind a driver (see the module docstring).

    ``address``: e.g. ``tcp://127.0.0.1:5590``. ``request_timeout`` bounds ``act`` /
    ``observe`` (seconds), ``reset_timeout`` bounds ``reset`` (a robot may take a while to
    go home); a timed-out request is retried ``retries`` times on a fresh socket (same
    sequence number, so the driver never executes an action twice) before the link is
    declared lost.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, address: str = f"tcp://127.0.0.1:{DEFAULT_PORT}", *, client_id: str | None = None,
                 connect_timeout: float = 10.0, request_timeout: float = 5.0, reset_timeout: float = 60.0,
                 retries: int = 2, heartbeat_period: float = 0.2, heartbeat_timeout: float = 1.0,
                 stop_on_close: bool = True, curve_server_public: str | None = None,
                 curve_client_key: str | None = None, ctx: zmq.Context | None = None,
                 spec: Mapping[str, Any] | None = None):
        self.address = address
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.connect_timeout = float(connect_timeout)
        self.request_timeout = float(request_timeout)
        self.reset_timeout = float(reset_timeout)
        self.retries = int(retries)
        self.heartbeat_period = float(heartbeat_period)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.stop_on_close = bool(stop_on_close)
        self._curve = {"server_public": curve_server_public, "client_key": curve_client_key}
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._req = itertools.count(1)
        self._seq = 0
        self._hb: _Heartbeat | None = None
        self._last_obs: dict[str, Any] | None = None
        self._closed = False
        self.driver_id = ""
        self._controlling = False
        self.robot_spec: dict = {}
        if spec is not None:
            # spaces from the config: nothing is contacted until reset (a learner can read
            # the spec without reaching the robot); the driver's spec is checked then
            self.robot_spec = dict(spec)
            a = int(self.robot_spec["action_dim"])
            self._act_low = np.asarray(self.robot_spec.get("action_low", [-1.0] * a), np.float32)
            self._act_high = np.asarray(self.robot_spec.get("action_high", [1.0] * a), np.float32)
        else:
            self._handshake(self.connect_timeout, control=False)  # control is taken on reset
        self._build_spaces(self.robot_spec)

    def _build_spaces(self, s: Mapping[str, Any]) -> None:
        obs_spaces: dict[str, spaces.Space] = {
            OBS_STATE: spaces.Box(-np.inf, np.inf, (int(s["state_dim"]),), np.float32)
        }
        for cam, shape in sorted(dict(s.get("cameras") or {}).items()):
            obs_spaces[OBS_IMAGE_PREFIX + cam] = spaces.Box(0, 255, tuple(int(v) for v in shape), np.uint8)
        if s.get("has_task", False):
            obs_spaces[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(self._act_low, self._act_high, dtype=np.float32)
        self.default_max_episode_steps = int(s.get("default_max_episode_steps") or 0) or None
        if s.get("ee_pos_index"):
            self.ee_pos_index = tuple(s["ee_pos_index"])
        if s.get("action_pos_index"):
            self.action_pos_index = tuple(s["action_pos_index"])
        if s.get("control_hz"):
            self.metadata = {**self.metadata, "render_fps": s["control_hz"]}
        self.spec = gym.envs.registration.EnvSpec(id="tandem/robot-v0", entry_point="envs.robot:RobotEnv")

    def _check_driver_spec(self, d: Mapping[str, Any]) -> None:
        mine = self.robot_spec
        problems = []
        for key in ("state_dim", "action_dim", "has_task"):
            if key in mine and mine[key] != d.get(key):
                problems.append(f"{key}: configured {mine[key]!r}, driver {d.get(key)!r}")
        cams_mine = {k: list(v) for k, v in dict(mine.get("cameras") or {}).items()}
        if cams_mine != {k: list(v) for k, v in d.get("cameras", {}).items()}:
            problems.append(f"cameras: configured {cams_mine}, driver {d.get('cameras')}")
        if problems:
            raise RobotError("spec_mismatch", "; ".join(problems))

    # -- transport

    def _new_socket(self) -> zmq.Socket:
        if self._sock is not None:
            self._sock.close(0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        _curve_setup(sock, **self._curve)
        sock.connect(self.address)
        self._sock = sock
        return sock

    def _request(self, msg_type: str, fields: dict, arrays: dict | None = None, *,
                 timeout: float | None = None, retries: int | None = None):
        """Send and wait for the matching reply; retry on a fresh socket; raise
        RobotLinkLost when all tries time out, RobotError on an error reply."""
        timeout = self.request_timeout if timeout is None else timeout
        tries = 1 + (self.retries if retries is None else retries)
        for _ in range(tries):
            req = next(self._req)
            sock = self._sock or self._new_socket()
            frames = encode(msg_type, {"client_id": self.client_id, "req": req, **fields}, arrays,
                            schemas=DRIVER_SCHEMAS)
            sock.send_multipart(frames, copy=False)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, int(left * 1000))):
                    break
                try:
                    msg = decode(sock.recv_multipart(copy=False), schemas=DRIVER_SCHEMAS,
                                 max_bytes=MAX_DRIVER_MESSAGE_BYTES)
                except CodecError as exc:
                    raise RobotError("bad_reply", str(exc)) from exc
                if msg["req"] != req:
                    continue  # a late reply to an earlier, timed-out request
                if msg.type == "error":
                    if msg["code"] == "not_controller":
                        raise RobotLinkLost(f"the driver dropped this client: {msg['message']}")
                    if msg["code"] == "stopped":
                        raise RobotStopped(msg["code"], msg["message"])
                    raise RobotError(msg["code"], msg["message"])
                return msg
            self._new_socket()  # lazy pirate: drop whatever is queued on the old socket
        raise RobotLinkLost(f"robot driver at {self.address} did not answer {msg_type!r} "
                            f"within {tries} x {timeout:.1f} s")

    def _handshake(self, timeout: float, *, control: bool = True) -> None:
        msg = self._request("hello" if control else "describe", {"driver_protocol": DRIVER_PROTOCOL_VERSION},
                            timeout=timeout, retries=0)
        if msg["driver_protocol"] != DRIVER_PROTOCOL_VERSION:
            raise RobotError("protocol", f"driver speaks driver protocol {msg['driver_protocol']}, "
                                         f"this client {DRIVER_PROTOCOL_VERSION}")
        self.driver_id = msg["driver_id"]
        driver_spec = json.loads(msg["spec"])
        if self.robot_spec:
            self._check_driver_spec(driver_spec)
        else:
            self.robot_spec = driver_spec
            self._act_low = np.asarray(msg.arrays["action_low"], np.float32).copy()
            self._act_high = np.asarray(msg.arrays["action_high"], np.float32).copy()
        if control:
            self._start_heartbeat()
            self._controlling = True

    def _start_heartbeat(self) -> None:
        self._stop_heartbeat()
        self._hb = _Heartbeat(self._ctx, self.address, self.client_id, self.heartbeat_period,
                              self.heartbeat_timeout, self._curve)
        self._hb.start()

    def _stop_heartbeat(self) -> None:
        if self._hb is not None:
            self._hb.halt.set()
            self._hb.join(timeout=2.0)
            self._hb = None

    @property
    def link_lost(self) -> bool:
        return self._hb is not None and self._hb.lost.is_set()

    def _obs_from(self, msg) -> dict[str, Any]:
        obs: dict[str, Any] = {k: np.array(v) for k, v in msg.arrays.items()}
        if TASK in self.observation_space.spaces:
            obs[TASK] = msg["task"]
        for k, sp in self.observation_space.spaces.items():
            if k != TASK and (k not in obs or obs[k].shape != sp.shape or obs[k].dtype != sp.dtype):
                raise RobotError("bad_obs", f"{k}: expected {sp.dtype}{sp.shape}, got "
                                            f"{obs[k].dtype}{obs[k].shape}" if k in obs else f"{k} missing")
        return obs

    def _lost(self, why: str) -> RobotLinkLost:
        try:
            self._request("stop", {"reason": f"client: {why}"}, timeout=0.3, retries=0)
        except (RobotLinkLost, RobotError):
            pass
        return RobotLinkLost(f"link to the robot driver at {self.address} lost ({why}); stop sent")

    # -- gymnasium API

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        fields = {"seed": -1 if seed is None else int(seed),
                  "options": json.dumps(jsonable(options or {}))}
        if self.link_lost or not self._controlling:
            self._handshake(self.connect_timeout)
        try:
            msg = self._request("reset", fields, timeout=self.reset_timeout, retries=0)
        except RobotLinkLost:
            # dropped by the driver (e.g. our heartbeat lapsed while paused): handshake again
            self._handshake(self.connect_timeout)
            msg = self._request("reset", fields, timeout=self.reset_timeout, retries=0)
        self._seq = int(msg["seq"])
        obs = self._obs_from(msg)
        self._last_obs = obs
        info = json.loads(msg["info"] or "{}")
        return obs, info

    def step(self, action):
        if not self._controlling:
            raise RuntimeError("call reset() first: the client takes control of the robot on reset")
        if self.link_lost:
            raise self._lost("heartbeat lost")
        a = np.asarray(action, dtype=np.float32).reshape(self.action_space.shape)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"non-finite action {a}")
        a = np.clip(a, self.action_space.low, self.action_space.high)
        self._seq += 1
        try:
            msg = self._request("act", {"seq": self._seq}, {"action": a})
        except RobotLinkLost:
            raise self._lost("act timed out") from None
        obs = self._obs_from(msg)
        self._last_obs = obs
        info = json.loads(msg["info"] or "{}")
        info["driver_stopped"] = bool(msg["stopped"])
        return obs, float(msg["reward"]), bool(msg["terminated"]), bool(msg["truncated"]), info

    def observe(self) -> dict[str, Any]:
        """The robot's current observation, without moving it."""
        if not self._controlling:
            raise RuntimeError("call reset() first")
        if self.link_lost:
            raise self._lost("heartbeat lost")
        obs = self._obs_from(self._request("observe", {}))
        self._last_obs = obs
        return obs

    def stop(self, reason: str = "client request") -> None:
        """Tell the driver to stop the robot now (it stays stopped until the next reset)."""
        self._request("stop", {"reason": reason}, retries=0)

    def render(self):
        if self._last_obs is None:
            return None
        imgs = [v for k, v in self._last_obs.items() if k.startswith(OBS_IMAGE_PREFIX)]
        return np.concatenate(imgs, axis=1) if imgs else None

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            if self._controlling and self.stop_on_close and not self.link_lost:
                try:
                    self._request("bye", {}, timeout=1.0, retries=0)
                except (RobotLinkLost, RobotError):
                    pass
        finally:
            self._stop_heartbeat()
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None


def make_robot_env(cfg: dict) -> RobotEnv:
    """Factory for :mod:`envs.registry` (``name: robot``; ``host``, ``port`` or ``address``)."""
    address = cfg.get("address") or f"tcp://{cfg.get('host', '127.0.0.1')}:{int(cfg.get('port', DEFAULT_PORT))}"
    if not is_loopback(address) and not cfg.get("curve_server_public") and not cfg.get("insecure", False):
        raise ValueError(
            f"robot driver address {address} is not loopback: give curve_server_public + "
            "curve_client_key (zmq CURVE certificates) or set insecure: true"
        )
    return RobotEnv(
        address, client_id=cfg.get("client_id"),
        connect_timeout=float(cfg.get("connect_timeout", 10.0)),
        request_timeout=float(cfg.get("request_timeout", 5.0)),
        reset_timeout=float(cfg.get("reset_timeout", 60.0)),
        retries=int(cfg.get("retries", 2)),
        heartbeat_period=float(cfg.get("heartbeat_period", 0.2)),
        heartbeat_timeout=float(cfg.get("heartbeat_timeout", 1.0)),
        stop_on_close=bool(cfg.get("stop_on_close", True)),
        curve_server_public=cfg.get("curve_server_public"),
        curve_client_key=cfg.get("curve_client_key"),
        spec=cfg.get("spec"),
    )
