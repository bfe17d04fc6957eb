"""The client end of the driver protocol (:mod:`envs.robot.protocol`): a robot behind a
driver, as a gymnasium env.

The client's spaces come from the driver (``describe``), or from the config's ``spec``
(``state_dim``, ``action_dim``, ``cameras``, ``has_task``, optional ``action_low/high``,
``default_max_episode_steps``, ``ee_pos_index``, ``action_pos_index``, ``control_hz``):
then nothing is contacted before the first ``reset`` (a learner on another machine can
build the env to read its spec), and the driver's spec is checked against it at the
handshake.

Client-side safety (this module): actions are clipped to the action space (and, through
:func:`envs.registry.make_env`, the config's ``safety`` block adds workspace bounds); a
background thread sends heartbeats on its own socket and, when the driver stops answering
for ``heartbeat_timeout``, marks the link lost: the next ``step`` sends a best-effort
``stop`` and raises :class:`RobotLinkLost`. ``reset`` re-handshakes, so an actor can
recover after the driver comes back. While the actor's policy gives no action (its learner
could not serve), :meth:`RobotEnv.on_policy_outage` stops the arm (``on_outage: stop``, the
default) or lets it hold (``hold``).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import uuid
from typing import Any, Mapping

import gymnasium as gym
import numpy as np
import zmq
from gymnasium import spaces

from data.core.codec import CodecError, decode, encode
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.security import configure_client_socket
from envs.robot.protocol import (
    DEFAULT_PORT, DRIVER_PROTOCOL_VERSION, DRIVER_SCHEMAS, MAX_DRIVER_MESSAGE_BYTES, RobotError,
    RobotLinkLost, RobotStopped, endpoint_is_loopback, jsonable, obs_from_message,
)
from envs.robot.heartbeat import Heartbeat
from envs.spec import camera_strip, checked_action
from envs.wrappers import TEXT_SPACE


class RobotEnv(gym.Env):
    """Client env for a robot behind a driver (see the module docstring).

    ``address``: e.g. ``tcp://127.0.0.1:5590``. ``request_timeout`` bounds ``act`` /
    ``observe`` (seconds), ``reset_timeout`` bounds ``reset`` (a robot may take a while to
    go home); a timed-out request is retried ``retries`` times on a fresh socket (same
    sequence number, so the driver never executes an action twice) before the link is
    declared lost. CURVE: ``curve_server_public`` is the driver's public key file,
    ``curve_client_key`` this client's secret key file (both ``zmq.auth`` certificates).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, address: str = f"tcp://127.0.0.1:{DEFAULT_PORT}", *, client_id: str | None = None,
                 connect_timeout: float = 10.0, request_timeout: float = 5.0, reset_timeout: float = 60.0,
                 retries: int = 2, heartbeat_period: float = 0.2, heartbeat_timeout: float = 1.0,
                 stop_on_close: bool = True, curve_server_public: str | None = None,
                 curve_client_key: str | None = None, ctx: zmq.Context | None = None,
                 spec: Mapping[str, Any] | None = None, on_outage: str = "stop"):
        if bool(curve_server_public) != bool(curve_client_key):
            raise ValueError("CURVE needs both curve_server_public (the driver's public key file) "
                             "and curve_client_key (this client's secret key file)")
        self.address = address
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.connect_timeout = float(connect_timeout)
        self.request_timeout = float(request_timeout)
        self.reset_timeout = float(reset_timeout)
        self.retries = int(retries)
        self.heartbeat_period = float(heartbeat_period)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.stop_on_close = bool(stop_on_close)
        if on_outage not in ("stop", "hold"):
            raise ValueError(f"on_outage must be stop or hold, got {on_outage!r}")
        #: what the arm does while the actor's policy gives no action (:meth:`on_policy_outage`)
        self.on_outage = on_outage
        self._security = {"server_public_key": curve_server_public, "client_secret_key": curve_client_key}
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._req = itertools.count(1)
        self._seq = 0
        self._hb: Heartbeat | None = None
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
        limit = s.get("default_max_episode_steps") or s.get("max_episode_steps")  # either name
        self.default_max_episode_steps = int(limit or 0) or None
        if s.get("ee_pos_index"):
            self.ee_pos_index = tuple(s["ee_pos_index"])
        if s.get("action_pos_index"):
            self.action_pos_index = tuple(s["action_pos_index"])
        if s.get("control_hz"):
            self.metadata = {**self.metadata, "render_fps": s["control_hz"]}
        self.spec = gym.envs.registration.EnvSpec(id="tandem/robot-v0",
                                                  entry_point="envs.robot.client:RobotEnv")

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
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DRIVER_MESSAGE_BYTES)
        sock.linger = 0
        configure_client_socket(sock, self._security)
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
        self._hb = Heartbeat(self._ctx, self.address, self.client_id, self.heartbeat_period,
                              self.heartbeat_timeout, self._security)
        self._hb.start()

    def _stop_heartbeat(self) -> None:
        if self._hb is not None:
            self._hb.halt.set()
            self._hb.join(timeout=2.0)
            self._hb = None

    @property
    def link_lost(self) -> bool:
        return self._hb is not None and self._hb.lost.is_set()

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
        obs = obs_from_message(msg, self.observation_space)
        self._last_obs = obs
        info = json.loads(msg["info"] or "{}")
        return obs, info

    def step(self, action):
        if not self._controlling:
            raise RuntimeError("call reset() first: the client takes control of the robot on reset")
        if self.link_lost:
            raise self._lost("heartbeat lost")
        a = checked_action(action, self.action_space.shape, np.float32, self.action_space.low,
                           self.action_space.high)
        self._seq += 1
        try:
            msg = self._request("act", {"seq": self._seq}, {"action": a})
        except RobotLinkLost:
            raise self._lost("act timed out") from None
        obs = obs_from_message(msg, self.observation_space)
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
        obs = obs_from_message(self._request("observe", {}), self.observation_space)
        self._last_obs = obs
        return obs

    def stop(self, reason: str = "client request") -> None:
        """Tell the driver to stop the robot now (it stays stopped until the next reset)."""
        self._request("stop", {"reason": reason}, retries=0)

    def on_policy_outage(self, reason: str) -> bool:
        """The actor's policy gives no action (its learner could not serve): with
        ``on_outage: stop`` (the default) the driver stops the arm until the next reset and
        this returns True (the episode cannot go on); with ``hold`` the heartbeats keep the
        link and the arm waits for its next command (False)."""
        if self.on_outage == "hold" or not self._controlling or self.link_lost:
            return self.on_outage != "hold"
        try:
            self.stop(f"policy outage: {reason}"[:200])
        except (RobotLinkLost, RobotError):
            pass  # the driver stops by itself once the heartbeats or commands end
        return True

    def render(self):
        return camera_strip(self._last_obs)

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
    """Factory for :mod:`envs.registry` (``name: robot``; ``host``, ``port`` or ``address``;
    every key is documented in ``config/env/robot.yaml``)."""
    host, port = cfg.get("host", "127.0.0.1"), int(cfg.get("port", DEFAULT_PORT))
    address = cfg.get("address") or f"tcp://{host}:{port}"
    secured = bool(cfg.get("curve_server_public")) or bool(cfg.get("insecure", False))
    if not endpoint_is_loopback(address) and not secured:
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
        spec=cfg.get("spec"), on_outage=str(cfg.get("on_outage", "stop")),
    )
