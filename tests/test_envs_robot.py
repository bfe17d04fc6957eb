"""The robot driver protocol over real loopback sockets: the reference driver wrapping a
simulator, a client env, lost heartbeats in both directions, retries that must not move
the robot twice, one controller at a time, and the CURVE / loopback rules."""

from __future__ import annotations

import ctypes.util
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import zmq

from data.core.codec import decode, encode
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.registry import make_env, make_raw_env
from envs.robot import DRIVER_SCHEMAS, RobotEnv, RobotError, RobotLinkLost, RobotStopped
from envs.robot.driver import RobotDriverServer, serve_in_thread
from envs.spec import spec_from_env
from tandem_testutil import ROOT, free_port

SIM_CFG = {"name": "gym_hil", "task": "PandaPickCube", "image_size": 32}


@pytest.fixture
def driver():
    # the config, not an env: the driver builds (and renders) it on its own thread
    server, thread = serve_in_thread(SIM_CFG, heartbeat_timeout=0.6)
    yield server
    server.shutdown()
    thread.join(timeout=5)
    server.close()


def _port(server) -> int:
    return int(server.endpoint.rsplit(":", 1)[1])


def wait_for(cond, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def test_client_env_drives_the_simulator(driver):
    env = make_env({"name": "robot", "port": _port(driver), "heartbeat_timeout": 0.6,
                    "max_episode_steps": 4,
                    "safety": {"workspace_low": [0.2, -0.3, 0.0], "workspace_high": [0.6, 0.3, 0.5]}})
    try:
        spec = spec_from_env(env)
        sim_spec = spec_from_env(make_env(SIM_CFG))
        assert spec.state_dim == sim_spec.state_dim == 18 and spec.action_dim == 4
        assert spec.cameras == sim_spec.cameras == {"front": (32, 32, 3), "wrist": (32, 32, 3)}
        assert spec.has_task and spec.max_episode_steps == 4
        assert env.unwrapped.ee_pos_index == (15, 16, 17)
        obs, info = env.reset(seed=1)
        assert env.observation_space.contains(obs) and obs[TASK] == "pick up the cube"
        z0 = obs[OBS_STATE][17]
        flags = []
        for _ in range(4):
            obs, r, term, trunc, info = env.step(np.array([0, 0, 1, 0], np.float32))
            flags.append((term, trunc))
            assert info["safety"]["clipped"] is False and info["driver_stopped"] is False
        assert obs[OBS_STATE][17] > z0 + 0.02  # the arm went up
        assert flags[-1] == (False, True)        # the client's time limit
        again = env.unwrapped.observe()          # observe does not move the robot
        assert np.allclose(again[OBS_STATE][15:18], obs[OBS_STATE][15:18], atol=1e-6)
        assert obs[OBS_IMAGE_PREFIX + "front"].dtype == np.uint8
        assert driver.stats["acts"] == 4 and driver.stats["resets"] == 1
        # the limit is the actor's (the driver runs the raw env): a new episode just works
        env.reset(seed=2)
        env.step(np.zeros(4, np.float32))
    finally:
        env.close()
    assert wait_for(lambda: driver.controller is None, 2.0) and driver.stopped  # bye stops it


def test_retried_act_is_not_executed_twice_and_one_controller(driver):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(driver.endpoint)

    def call(t, fields, arrays=None):
        sock.send_multipart(encode(t, {"client_id": "raw", **fields}, arrays, schemas=DRIVER_SCHEMAS))
        assert sock.poll(5000)
        return decode(sock.recv_multipart(), schemas=DRIVER_SCHEMAS)

    assert call("hello", {"req": 1, "driver_protocol": 1}).type == "spec"
    act = {"action": np.array([0.5, 0, 0, 0], np.float32)}
    err = call("act", {"req": 2, "seq": 1}, act)
    assert err.type == "error" and err["code"] == "stopped"  # must reset first
    assert call("reset", {"req": 3, "seed": 0, "options": "{}"}).type == "obs"
    first = call("act", {"req": 4, "seq": 1}, act)
    retry = call("act", {"req": 5, "seq": 1}, act)   # e.g. the reply was lost
    assert first.type == retry.type == "obs" and retry["req"] == 5
    assert np.array_equal(first.arrays[OBS_STATE], retry.arrays[OBS_STATE])
    assert driver.stats["acts"] == 1
    bad = call("act", {"req": 6, "seq": 5}, act)
    assert bad.type == "error" and bad["code"] == "bad_seq"
    bad = call("act", {"req": 7, "seq": 2}, {"action": np.array([np.nan, 0, 0, 0], np.float32)})
    assert bad.type == "error" and bad["code"] == "bad_action"
    # a second client may read the spec, but is turned away when it tries to take control
    other = RobotEnv(driver.endpoint, connect_timeout=3.0)
    assert other.action_space.shape == (4,) and driver.controller == "raw"
    with pytest.raises(RuntimeError, match="reset"):
        other.step(np.zeros(4, np.float32))
    with pytest.raises(RobotError, match="busy"):
        other.reset()
    other.close()
    assert driver.controller == "raw" and not driver.stopped
    # garbage is answered with an error and the driver keeps serving
    sock.send_multipart([b"\x00not msgpack"])
    assert sock.poll(5000) and decode(sock.recv_multipart(), schemas=DRIVER_SCHEMAS).type == "error"
    assert call("heartbeat", {"req": 8, "t": 1.0}).type == "heartbeat_ack"
    assert call("bye", {"req": 9}).type == "stopped"
    sock.close(0)


CLIENT = textwrap.dedent("""
    import sys, time, numpy as np
    from envs.robot import RobotEnv
    env = RobotEnv(sys.argv[1], heartbeat_period=0.1, heartbeat_timeout=0.6)
    env.reset(seed=0)
    env.step(np.zeros(4, np.float32))
    print("ready", flush=True)
    time.sleep(600)
""")


def test_driver_stops_the_robot_when_the_client_dies(driver):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, driver.endpoint], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert not driver.stopped and driver.controller is not None
        time.sleep(1.0)  # heartbeats keep an idle client's robot armed
        assert not driver.stopped
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_for(lambda: driver.stopped, 3.0)
        assert time.monotonic() - t0 < 2.0
        assert "heartbeat" in driver.stop_reason and driver.stats["heartbeat_stops"] == 1
        assert driver.controller is None
    finally:
        proc.kill()
        proc.wait()
    # another actor may take over; its reset re-arms the robot; an explicit stop holds it
    env = RobotEnv(driver.endpoint, heartbeat_timeout=0.6)
    try:
        env.reset(seed=0)
        assert not driver.stopped
        env.step(np.zeros(4, np.float32))
        env.unwrapped.stop("operator")
        assert driver.stopped and "operator" in driver.stop_reason
        with pytest.raises(RobotStopped):
            env.step(np.zeros(4, np.float32))
        env.reset(seed=0)
        env.step(np.zeros(4, np.float32))
    finally:
        env.close()


CHUNK_CLIENT = textwrap.dedent("""
    import sys, numpy as np
    from envs.robot import RobotEnv
    env = RobotEnv(sys.argv[1], heartbeat_period=0.1, heartbeat_timeout=0.6)
    env.reset(seed=0)
    print("ready", flush=True)
    try:
        for _ in range(100_000):  # one long action chunk, executed act by act
            env.step(np.array([0, 0, 0.2, 0], np.float32))
    except Exception as exc:
        print("raised", type(exc).__name__, exc, flush=True)
""")


def _assert_heartbeat_stop(driver, timeout: float = 0.6) -> int:
    """The driver stopped the robot because the heartbeat lapsed, within the timeout of
    the last message it heard (plus its 50 ms poll and some scheduling slack)."""
    assert wait_for(lambda: driver.stopped, 3.0), "the driver never stopped the robot"
    assert "heartbeat" in driver.stop_reason and driver.stats["heartbeat_stops"] == 1
    assert driver.controller is None
    silent = driver.stopped_at - driver.last_seen
    assert timeout <= silent < timeout + 0.5, silent
    return driver.stats["acts"]


def test_driver_stops_the_robot_when_the_client_freezes_mid_chunk(driver):
    """SIGSTOP freezes the client (its heartbeat thread too) while it streams a chunk of
    acts: the driver stops the robot within the heartbeat timeout, and the thawed client
    can move it no further (its next act fails; only a reset would re-arm)."""
    proc = subprocess.Popen([sys.executable, "-c", CHUNK_CLIENT, driver.endpoint], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert wait_for(lambda: driver.stats["acts"] >= 5, 10.0)
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        acts = _assert_heartbeat_stop(driver)
        assert time.monotonic() - t0 < 2.0
        assert acts >= 5
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=20)
        assert "raised RobotLinkLost" in out, out + err[-2000:]
        assert driver.stats["acts"] == acts and driver.stopped  # nothing moved after the stop
    finally:
        proc.kill()
        proc.wait()


class TcpRelay(threading.Thread):
    """A loopback TCP relay to ``port``: the link between a client and the driver. ``cut()``
    closes every connection and the listener, as a pulled cable or a dead switch would."""

    def __init__(self, port: int):
        super().__init__(daemon=True, name="tcp-relay")
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._cut = threading.Event()

    def run(self) -> None:
        peer: dict[socket.socket, socket.socket] = {}
        while not self._cut.is_set():
            ready, _, _ = select.select([self.listener, *peer], [], [], 0.02)
            for s in ready:
                if s is self.listener:
                    a, _ = s.accept()
                    b = socket.create_connection(("127.0.0.1", self.target))
                    peer[a], peer[b] = b, a
                    continue
                if s not in peer:
                    continue
                try:
                    data = s.recv(1 << 16)
                    if data:
                        peer[s].sendall(data)
                        continue
                except OSError:
                    pass
                other = peer.pop(s)
                peer.pop(other, None)
                s.close()
                other.close()
        for s in [self.listener, *peer]:
            s.close()

    def cut(self) -> None:
        self._cut.set()
        self.join(timeout=2.0)


def test_driver_stops_the_robot_when_the_link_dies_mid_chunk(driver):
    relay = TcpRelay(_port(driver))
    relay.start()
    env = RobotEnv(f"tcp://127.0.0.1:{relay.port}", heartbeat_period=0.1, heartbeat_timeout=0.6,
                   request_timeout=0.5, retries=1)
    raised: dict = {}

    def run_chunk() -> None:
        try:
            for _ in range(100_000):
                env.step(np.array([0, 0, 0.2, 0], np.float32))
        except Exception as exc:  # noqa: BLE001 - the test checks which
            raised["exc"], raised["t"] = exc, time.monotonic()

    try:
        env.reset(seed=0)
        chunk = threading.Thread(target=run_chunk, daemon=True)
        chunk.start()
        assert wait_for(lambda: driver.stats["acts"] >= 5, 10.0)
        relay.cut()
        t_cut = time.monotonic()
        acts = _assert_heartbeat_stop(driver)
        assert time.monotonic() - t_cut < 2.0
        chunk.join(timeout=10.0)
        assert isinstance(raised.get("exc"), RobotLinkLost), raised
        assert raised["t"] - t_cut < 3.0  # the actor learns of it fast, too
        time.sleep(0.3)
        assert driver.stats["acts"] == acts and driver.stopped
    finally:
        env.close()


@pytest.mark.skipif(ctypes.util.find_library("EGL") is None, reason="no libEGL")
def test_driver_thread_renders_on_egl():
    """Defect: with EGL, an env built on one thread and rendered on the driver's thread failed
    with EGL_BAD_ACCESS. serve_in_thread builds it on the serving thread; an instance that
    would render on EGL from another thread is refused with the fix named."""
    code = textwrap.dedent("""
        import os; os.environ["MUJOCO_GL"] = "egl"
        import numpy as np
        from envs.registry import make_raw_env
        from envs.robot import RobotEnv
        from envs.robot.driver import serve_in_thread
        cfg = {"name": "gym_hil", "task": "PandaPickCube", "image_size": 32}
        try:
            serve_in_thread(make_raw_env(cfg))
        except ValueError as exc:
            print("refused:", exc)
        server, thread = serve_in_thread(cfg)
        env = RobotEnv(server.endpoint)
        obs, _ = env.reset(seed=0)
        obs, *_ = env.step(np.zeros(4, np.float32))
        print("std", float(obs["observation.images.front"].std()), os.environ["MUJOCO_GL"])
        env.close(); server.shutdown(); thread.join(5)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: serve_in_thread: this env renders cameras with MUJOCO_GL=egl" in out.stdout
    std = [ln for ln in out.stdout.splitlines() if ln.startswith("std")][0].split()
    assert float(std[1]) > 5 and std[2] == "egl"


@pytest.mark.parametrize("gl,lib", [("osmesa", "OSMesa"), ("egl", "EGL")])
def test_an_env_instance_is_closed_by_its_owner_on_its_own_thread(gl, lib):
    """Defect: gym-hil makes a GL context current on the thread that builds it, even without
    cameras. serve_in_thread(instance) closed that env on the serving thread; OSMesa then
    destroyed a context still current on the main thread, and the next renderer built there
    segfaulted. The instance stays its owner's: closed on the thread that built it."""
    if ctypes.util.find_library(lib) is None:
        pytest.skip(f"no lib{lib}")
    code = textwrap.dedent(f"""
        import os; os.environ["MUJOCO_GL"] = "{gl}"
        from envs.registry import make_raw_env
        from envs.robot.driver import serve_in_thread
        cfg = {{"name": "gym_hil", "task": "PandaPickCube", "image_size": 32}}
        sim = make_raw_env({{**cfg, "cameras": {{}}}})
        server, thread = serve_in_thread(sim)
        server.shutdown(); thread.join(30)
        assert not thread.is_alive()
        sim.reset(seed=0)  # not closed by the driver
        sim.close()
        env = make_raw_env(cfg)
        obs, _ = env.reset(seed=0)
        print("std", float(obs["observation.images.front"].std()))
        env.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "MALLOC_PERTURB_": "165"})  # freed memory poisoned
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert float(out.stdout.split()[-1]) > 5


def test_client_detects_a_dead_driver_and_recovers_when_it_returns():
    port = free_port()
    cmd = [sys.executable, "-m", "envs.robot.driver", "--env", "gym_hil", "--set", "cameras={}",
           "--port", str(port), "--heartbeat-timeout", "0.6", "--log-level", "WARNING"]

    def start():
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert "ready" in line, p.stderr.read()
        return p

    proc = start()
    env = make_env({"name": "robot", "port": port, "heartbeat_period": 0.1, "heartbeat_timeout": 0.5,
                    "request_timeout": 1.0, "retries": 1})
    try:
        env.reset(seed=0)
        env.step(np.zeros(4, np.float32))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: env.unwrapped.link_lost, 3.0)
        t0 = time.monotonic()
        with pytest.raises(RobotLinkLost, match="heartbeat lost"):
            env.step(np.zeros(4, np.float32))
        assert time.monotonic() - t0 < 1.5  # best-effort stop, then fail fast
        proc = start()  # the driver comes back: reset reconnects
        obs, _ = env.reset(seed=0)
        assert obs[OBS_STATE].shape == (21,)  # state-only: cube position appended
        env.step(np.zeros(4, np.float32))
    finally:
        env.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_spec_from_config_connects_only_on_reset(driver):
    spec = {"state_dim": 18, "action_dim": 4, "has_task": True,
            "cameras": {"front": [32, 32, 3], "wrist": [32, 32, 3]}, "default_max_episode_steps": 100}
    port = free_port()  # nothing listens here: building the env must not need the driver
    env = make_env({"name": "robot", "port": port, "spec": spec})
    assert spec_from_env(env).cameras == {"front": (32, 32, 3), "wrist": (32, 32, 3)}
    assert env.spec.max_episode_steps == 100
    env.close()
    env = make_env({"name": "robot", "port": _port(driver), "spec": spec})
    try:
        env.reset(seed=0)
        env.step(np.zeros(4, np.float32))
    finally:
        env.close()
    wrong = make_env({"name": "robot", "port": _port(driver), "spec": {**spec, "state_dim": 7}})
    with pytest.raises(RobotError, match="state_dim: configured 7, driver 18"):
        wrong.reset()
    wrong.close()


def test_bind_rules_and_curve(tmp_path):
    sim = make_raw_env({**SIM_CFG, "cameras": {}})
    with pytest.raises(ValueError, match="refusing to bind"):
        RobotDriverServer(sim, "tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="not loopback"):
        make_env({"name": "robot", "host": "10.1.2.3", "port": 5590})
    from zmq import auth

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    _, server_secret = auth.create_certificates(str(keys), "server")
    client_public, client_secret = auth.create_certificates(str(keys), "client")
    os.replace(client_public, clients / "client.key")
    server, thread = serve_in_thread(sim, "tcp://127.0.0.1:0", curve_secret=server_secret,
                                     curve_clients=str(clients), heartbeat_timeout=1.0)
    try:
        env = RobotEnv(server.endpoint, curve_server_public=str(keys / "server.key"),
                       curve_client_key=client_secret)
        env.reset(seed=0)
        env.step(np.zeros(4, np.float32))
        env.close()
        # without keys the handshake never completes
        with pytest.raises(RobotLinkLost):
            RobotEnv(server.endpoint, connect_timeout=1.0)
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.close()
        sim.close()  # an instance stays ours: closed on the thread that built it
