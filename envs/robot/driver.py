"""Reference robot driver: serves any registered env over the driver protocol.

    python -m envs.robot.driver --env gym_hil --set task=PandaPickCube image_size=128 \\
        --bind tcp://127.0.0.1:5590

    python -m envs.robot.driver --env-config config/env/libero_spatial.yaml --port 5590

Then an actor with ``env=robot`` (``host``/``port`` of this driver) drives it exactly as it
would a real arm. A driver for real hardware implements the same messages (see
:mod:`envs.robot.protocol`); subclass :class:`RobotDriverServer` and give it an env whose
``step``/``reset`` move the arm and whose ``unwrapped.stop()`` (if present) halts it.

The driver runs the *raw* env (no time limit: episode length is the actor's business, the
driver reports the env's ``default_max_episode_steps``). A ``tcp://`` bind is served through
the wire gate (:mod:`data.core.gate`: its socket lives in a process of its own, so no peer can
abort the driver through libzmq or make it buffer without bound). It binds loopback by default;
another interface needs CURVE keys (``--curve-secret``: this driver's key file, and
``--curve-clients``: a folder of allowed client public keys, both ``zmq.auth``
certificates; applied by :mod:`data.core.security`) or ``--insecure``.

This module opens sockets: it is a process entry point, not something envs import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import uuid
from typing import Any, Callable, Mapping

import gymnasium as gym
import numpy as np
import zmq

from data.core.codec import CodecError, decode, encode
from data.core.gate import Front, Gate, GateError
from data.core.security import check_bind_policy, configure_server_socket
from envs.robot.protocol import (
    DEFAULT_PORT, DRIVER_PROTOCOL_VERSION, DRIVER_SCHEMAS, DRIVER_TO_CLIENT, MAX_DRIVER_MESSAGE_BYTES,
    endpoint_host, jsonable, obs_to_arrays, spec_message, with_req,
)

log = logging.getLogger("tandem.robot.driver")


class RobotDriverServer:
    """Serve one env to one controlling client at a time (see :mod:`envs.robot.protocol`).
    A non-loopback ``bind`` needs ``curve_secret`` (this driver's secret key file) and
    ``curve_clients`` (a folder of allowed client public keys), or ``insecure``."""

    def __init__(self, env: gym.Env, bind: str = f"tcp://127.0.0.1:{DEFAULT_PORT}", *,
                 heartbeat_timeout: float = 1.0, insecure: bool = False,
                 curve_secret: str | None = None, curve_clients: str | None = None,
                 ctx: zmq.Context | None = None):
        self.env = env
        self.bind = bind
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.driver_id = f"driver-{uuid.uuid4().hex[:8]}"
        self.spec = spec_message(env)
        self._spec_json = json.dumps(self.spec)
        self._ctx = ctx or zmq.Context.instance()
        security = {"server_secret_key": curve_secret, "authorized_keys_dir": curve_clients,
                    "allow_insecure": insecure}
        host = endpoint_host(bind)
        try:
            check_bind_policy(host, security)
        except ValueError as exc:
            raise ValueError(f"robot driver at {bind}: {exc} (here: curve_secret / curve_clients / "
                             "insecure, or --curve-secret / --curve-clients / --insecure)") from exc
        self._gate = None
        self._skip = 1  # frames before the message: [routing id, (CURVE User-Id,) ...]
        if bind.startswith("tcp://"):
            # the network-facing ROUTER lives in the wire gate's process (data/core/gate.py): no
            # peer can abort the driver (and the robot's safety loop) through libzmq, nor make
            # it buffer more than MAX_DRIVER_MESSAGE_BYTES per message
            too_large = encode("error", {"req": 0, "code": "message_too_large", "message":
                                         f"over {MAX_DRIVER_MESSAGE_BYTES} bytes"}, schemas=DRIVER_SCHEMAS)
            port = int(bind.rsplit(":", 1)[1])
            self._gate = Gate([Front("driver", host=host, port=port, max_frame_bytes=MAX_DRIVER_MESSAGE_BYTES,
                                     max_message_bytes=MAX_DRIVER_MESSAGE_BYTES,
                                     too_large_reply=[bytes(memoryview(f)) for f in too_large])],
                              security, memory_bytes=1 << 30)
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.linger = 0
            self._sock.setsockopt(zmq.SNDTIMEO, 0)  # a reply the gate cannot take is dropped
            self._sock.bind(self._gate.backends["driver"])
            try:
                port = self._gate.start()["driver"]
            except GateError as exc:
                self._sock.close(0)
                self._gate.stop()
                raise zmq.ZMQError(zmq.EADDRINUSE, f"robot driver at {bind}: {exc}") from None
            self._skip = 2 if curve_secret else 1
            self.bind = f"{bind[: bind.rindex(':')]}:{port}"
        else:  # ipc:// or inproc://: only this machine's processes reach it
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.linger = 0
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_DRIVER_MESSAGE_BYTES)
            configure_server_socket(self._sock, host, security)
            self._sock.bind(bind)
        self.endpoint = self.bind
        # session state
        self.controller: str | None = None
        self.last_seen = 0.0
        self.stopped = True          # nothing may move until a reset
        self.stop_reason = "not reset yet"
        self.stopped_at = 0.0        # time.monotonic() of the last stop
        self.episode_over = True
        self._last_seq = 0
        self._last_reply: list[Any] | None = None
        self._last_obs: dict[str, Any] | None = None
        self._halt = threading.Event()
        self._closed = False
        self.stats = {"acts": 0, "resets": 0, "heartbeat_stops": 0, "errors": 0}

    # -- helpers

    def _send(self, frames: list) -> None:
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:  # the wire gate is restarting: the client retries, as on a lost reply
            pass

    def _reply(self, ident, msg_type: str, fields: dict, arrays: dict | None = None) -> list[Any]:
        frames = encode(msg_type, fields, arrays, schemas=DRIVER_SCHEMAS)
        self._send([ident, *frames])
        return frames

    def _error(self, ident, req: int, code: str, message: str) -> None:
        self.stats["errors"] += 1
        self._reply(ident, "error", {"req": req, "code": code, "message": message})

    def _obs_reply(self, ident, req: int, obs, reward=0.0, terminated=False, truncated=False,
                   info=None) -> list[Any]:
        arrays, task = obs_to_arrays(obs)
        return self._reply(ident, "obs", {
            "req": req, "seq": self._last_seq, "reward": float(reward), "terminated": bool(terminated),
            "truncated": bool(truncated), "stopped": bool(self.stopped),
            "info": json.dumps(jsonable(info or {})), "task": task,
        }, arrays)

    def stop_robot(self, reason: str) -> None:
        """Halt the robot: the env's ``stop()`` if it has one; no more motion until reset."""
        if not self.stopped:
            log.warning("stopping the robot: %s", reason)
            self.stopped_at = time.monotonic()
            stop = getattr(self.env.unwrapped, "stop", None)
            if callable(stop):
                try:
                    stop()
                except Exception:  # a failing stop must not kill the driver
                    log.exception("env.stop() failed")
        self.stopped = True
        self.stop_reason = reason

    def _check_heartbeat(self) -> None:
        if self.controller is not None and time.monotonic() - self.last_seen > self.heartbeat_timeout:
            log.warning("heartbeat from %s lost (%.2f s)", self.controller, time.monotonic() - self.last_seen)
            if not self.stopped:
                self.stats["heartbeat_stops"] += 1
            self.stop_robot(f"heartbeat from {self.controller} lost")
            self.controller = None

    # -- message handling

    def handle(self, ident, frames) -> None:
        try:
            msg = decode(frames, schemas=DRIVER_SCHEMAS, max_bytes=MAX_DRIVER_MESSAGE_BYTES)
        except CodecError as exc:
            self._error(ident, 0, "bad_message", str(exc))
            return
        req = msg.get("req", 0) if isinstance(msg.get("req"), int) else 0
        client = msg.get("client_id")
        if msg.type in DRIVER_TO_CLIENT:
            self._error(ident, req, "bad_message", f"{msg.type!r} is a driver-to-client message")
            return
        now = time.monotonic()
        if msg.type in ("describe", "hello") and msg["driver_protocol"] != DRIVER_PROTOCOL_VERSION:
            self._error(ident, req, "protocol", f"driver speaks {DRIVER_PROTOCOL_VERSION}, "
                                                f"client {msg['driver_protocol']}")
            return
        if msg.type == "describe":
            self._send_spec(ident, req)
            return
        if msg.type == "hello":
            if self.controller not in (None, client):
                self._error(ident, req, "busy", f"robot is controlled by {self.controller}")
                return
            if self.controller != client:
                self._last_seq, self._last_reply = 0, None
            self.controller, self.last_seen = client, now
            self._send_spec(ident, req)
            return
        if client != self.controller:
            if msg.type == "heartbeat":  # a stale client: tell it it is stopped
                self._reply(ident, "heartbeat_ack", {"req": req, "t": msg["t"], "stopped": True})
            else:
                self._error(ident, req, "not_controller",
                            "send hello first" if self.controller is None
                            else f"robot is controlled by {self.controller}")
            return
        self.last_seen = now
        if msg.type == "heartbeat":
            self._reply(ident, "heartbeat_ack", {"req": req, "t": msg["t"], "stopped": self.stopped})
        elif msg.type == "reset":
            self._on_reset(ident, req, msg)
        elif msg.type == "act":
            self._on_act(ident, req, msg)
        elif msg.type == "observe":
            if self._last_obs is None:
                self._error(ident, req, "no_obs", "reset first")
                return
            obs = self._last_obs
            read = getattr(self.env.unwrapped, "observe", None)
            if callable(read) and not self.stopped:
                try:
                    obs = read()
                except Exception:  # fall back to the last observation
                    log.exception("observe failed")
            self._obs_reply(ident, req, obs)
        elif msg.type == "stop":
            self.stop_robot(f"client: {msg['reason']}")
            self._reply(ident, "stopped", {"req": req, "reason": self.stop_reason})
        elif msg.type == "bye":
            self.stop_robot("client said bye")
            self.controller = None
            self._reply(ident, "stopped", {"req": req, "reason": self.stop_reason})

    def _on_reset(self, ident, req: int, msg) -> None:
        seed = None if msg["seed"] < 0 else msg["seed"]
        try:
            options = json.loads(msg["options"] or "{}")
            obs, info = self.env.reset(seed=seed, options=options or None)
        except Exception as exc:
            log.exception("reset failed")
            self.stop_robot(f"reset failed: {exc}")
            self._error(ident, req, "reset_failed", f"{type(exc).__name__}: {exc}")
            return
        self.stats["resets"] += 1
        self.stopped, self.stop_reason, self.episode_over = False, "", False
        self._last_seq, self._last_reply = 0, None
        self._last_obs = obs
        self._obs_reply(ident, req, obs, info=info)

    def _on_act(self, ident, req: int, msg) -> None:
        seq = msg["seq"]
        if seq == self._last_seq and self._last_reply is not None:
            # a retry of the action we already executed: same answer, no motion
            self._send([ident, *with_req(self._last_reply, req)])
            return
        if self.stopped:
            self._error(ident, req, "stopped", f"robot is stopped ({self.stop_reason}); reset first")
            return
        if self.episode_over:
            self._error(ident, req, "episode_over", "the episode ended; reset first")
            return
        if seq != self._last_seq + 1:
            self._error(ident, req, "bad_seq", f"expected act seq {self._last_seq + 1}, got {seq}")
            return
        action = np.asarray(msg.arrays["action"], dtype=np.float32)
        space = self.env.action_space
        if action.shape != space.shape or not np.all(np.isfinite(action)):
            self._error(ident, req, "bad_action", f"action must be finite {space.shape}, got {action.shape}")
            return
        action = np.clip(action, space.low, space.high)
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except Exception as exc:
            log.exception("step failed")
            self.stop_robot(f"step failed: {exc}")
            self._error(ident, req, "step_failed", f"{type(exc).__name__}: {exc}")
            return
        self.stats["acts"] += 1
        self._last_seq = seq
        self._last_obs = obs
        self.episode_over = bool(terminated or truncated)
        frames = self._obs_reply(ident, req, obs, reward, terminated, truncated, info)
        self._last_reply = [bytes(memoryview(getattr(f, "buffer", f))) for f in frames]

    def _send_spec(self, ident, req: int) -> None:
        low = np.asarray(self.env.action_space.low, np.float32)
        high = np.asarray(self.env.action_space.high, np.float32)
        self._reply(ident, "spec", {"req": req, "driver_id": self.driver_id, "spec": self._spec_json,
                                    "driver_protocol": DRIVER_PROTOCOL_VERSION},
                    {"action_low": low, "action_high": high})

    # -- loop

    def serve(self, *, poll_ms: int = 50, until: float | None = None) -> None:
        """Serve until :meth:`shutdown` (or ``until`` seconds)."""
        end = None if until is None else time.monotonic() + until
        log.info("robot driver %s serving %s on %s", self.driver_id, self.spec.get("name"), self.endpoint)
        while not self._halt.is_set() and (end is None or time.monotonic() < end):
            if self._sock.poll(poll_ms):
                # drain everything queued (e.g. heartbeats that arrived during a slow step)
                # before judging the heartbeat
                while self._sock.poll(0):
                    parts = self._sock.recv_multipart(copy=False)
                    if len(parts) <= self._skip:
                        continue
                    self.handle(parts[0], parts[self._skip:])
            self._check_heartbeat()
            if self._gate is not None and self._gate.poll():  # it died: a new one serves
                log.error("robot driver: the wire gate was restarted (%d so far)", self._gate.restarts)

    def shutdown(self) -> None:
        self._halt.set()

    def close(self, close_env: bool = True) -> None:
        """Stop the robot, close the socket and (``close_env``) the env (once; later calls do
        nothing). Call it on the thread that serves (see :func:`serve_in_thread`)."""
        if self._closed:
            return
        self._closed = True
        self.stop_robot("driver shutting down")
        self._sock.close(0)
        if self._gate is not None:
            self._gate.stop()
        if close_env:
            self.env.close()


def serve_in_thread(env: gym.Env | Callable[[], gym.Env] | Mapping[str, Any], bind: str = "tcp://127.0.0.1:0",
                    *, start_timeout: float = 120.0, **kw) -> tuple[RobotDriverServer, threading.Thread]:
    """Start a driver on a background thread (tests, demos). Returns (server, thread);
    ``server.endpoint`` is the bound address; call ``server.shutdown()`` then join (the
    thread closes the server, and the env it built, when it stops serving).

    ``env`` is a zero-argument factory or an env config (built with
    :func:`envs.registry.make_raw_env`): the env is built, served, rendered and closed on
    the serving thread, because a GL context belongs to the thread that made it (EGL
    refuses ``eglMakeCurrent`` from another: ``EGL_BAD_ACCESS``). An env *instance* is
    accepted only when it renders nothing on EGL (no cameras, or another GL backend), and it
    stays the caller's to close, on the thread that built it: its GL context (gym-hil makes one
    even without cameras) is current there, and OSMesa destroying it from the serving thread
    left that thread a dangling current context (a segfault at its next GL call).
    """
    if isinstance(env, gym.Env):
        if os.environ.get("MUJOCO_GL", "").lower() == "egl" and spec_message(env)["cameras"]:
            raise ValueError(
                "serve_in_thread: this env renders cameras with MUJOCO_GL=egl, and its GL context "
                "belongs to the thread that built it; pass a factory (lambda: make_raw_env(cfg)) "
                "or the env config instead of the env, so that it is built on the serving thread")
        instance = env
        build: Callable[[], gym.Env] = lambda: instance  # noqa: E731
    elif isinstance(env, Mapping):
        cfg = dict(env)

        def build() -> gym.Env:
            from envs.registry import make_raw_env

            return make_raw_env(cfg)
    elif callable(env):
        build = env
    else:
        raise TypeError(f"serve_in_thread: env must be a gym.Env, a factory or a config, got {type(env).__name__}")
    box: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        built = None
        try:
            built = build()
            server = RobotDriverServer(built, bind, **kw)
        except BaseException as exc:  # handed to the caller below
            if built is not None and built is not env:
                built.close()
            box["error"] = exc
            ready.set()
            return
        box["server"] = server
        ready.set()
        try:
            server.serve()
        finally:
            server.close(close_env=built is not env)

    t = threading.Thread(target=run, name="robot-driver", daemon=True)
    t.start()
    if not ready.wait(start_timeout):
        raise TimeoutError(f"robot driver did not start within {start_timeout:.0f} s")
    if "error" in box:
        t.join()
        raise box["error"]
    return box["server"], t


def _parse_value(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m envs.robot.driver", description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", help="a registered env name (e.g. gym_hil, libero_spatial)")
    ap.add_argument("--env-config", help="an env config YAML (config/env/*.yaml)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="env config overrides")
    ap.add_argument("--bind", default=None, help=f"endpoint (default tcp://127.0.0.1:{DEFAULT_PORT})")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.0)
    ap.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE")
    ap.add_argument("--curve-secret", help="this driver's zmq.auth secret key file")
    ap.add_argument("--curve-clients", help="folder of allowed client public key files (with --curve-secret)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    cfg: dict[str, Any] = {}
    if args.env_config:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(args.env_config), resolve=True)
    if args.env:
        cfg["name"] = args.env
    for kv in args.set:
        k, _, v = kv.partition("=")
        cfg[k] = _parse_value(v)
    if not cfg.get("name"):
        ap.error("give --env or --env-config")
    if cfg["name"] == "robot":
        ap.error("the driver serves a simulator or hardware env, not another robot client")
    from envs.registry import make_raw_env

    env = make_raw_env(cfg)
    bind = args.bind or f"tcp://127.0.0.1:{args.port or DEFAULT_PORT}"
    server = RobotDriverServer(env, bind, heartbeat_timeout=args.heartbeat_timeout, insecure=args.insecure,
                               curve_secret=args.curve_secret, curve_clients=args.curve_clients)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    signal.signal(signal.SIGINT, lambda *_: server.shutdown())
    print(f"robot driver ready on {server.endpoint}", flush=True)
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main()
