"""No peer can abort the learner (issue 24, class 1). libzmq (4.3.5) names a peer that sets no
routing id ``\\0`` + a counter that starts, unseeded, at 0x6b8b4567 in every process's first
ROUTER; a peer may claim such an id itself, and the next generated one that meets it fails an
assertion in socket_base.cpp: the process aborts. The learner's network-facing sockets live in
the wire gate's process (data/core/gate.py): the learner process stays alive, a gate that dies
is replaced, and a real actor keeps acting. The same holds for the robot driver."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tools.bench.fuzz_attacks import routing_ids

BARE_ROUTER = """
import zmq
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER)
print(r.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    r.recv_multipart()
"""


def test_libzmq_aborts_a_process_whose_router_meets_a_crafted_routing_id():
    """The upstream mechanism, reproduced: a bare ROUTER in a fresh process."""
    p = subprocess.Popen([sys.executable, "-c", BARE_ROUTER], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        port = int(p.stdout.readline())
        routing_ids(ctx, [port], span=8, randoms=0, triggers=2)
        p.wait(10)
        assert p.returncode == -signal.SIGABRT
        assert "socket_base.cpp" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        ctx.destroy(0)


def _gate_pids(parent: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if "data.core.gate_main" in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                out.append(int(pid))
    return out


@pytest.mark.slow
def test_crafted_routing_ids_leave_the_learner_alive_and_the_actor_acting(tmp_path):
    from data.core.codec import decode, encode
    from test_integration import Run

    run = Run(tmp_path)
    run.env = "point_reach"
    ctx = zmq.Context()
    try:
        learner = run.learner("buffer.video=false")
        run.actor("a0")
        run.wait(lambda: run.status().get("received", {}).get("a0", -1) > 50, 120, "the actor to act")
        probe = ctx.socket(zmq.DEALER)  # the act port, as the welcome names it
        probe.connect(f"tcp://127.0.0.1:{run.port}")
        probe.send_multipart(encode("hello", {"actor_id": "probe", "config_hash": "x", "resend_from": 0}))
        assert probe.poll(10000)
        decode(probe.recv_multipart())
        probe.close(0)
        ports = [run.port, run.pub]
        act_port = run.port + 2
        ports.append(act_port)
        # the ids the learner's first ROUTERs would generate unseeded, and random ones, then
        # ordinary connections: the old learner aborted on one of them
        n = routing_ids(ctx, [run.port, act_port], span=64, randoms=64, triggers=4)
        assert n > 500
        time.sleep(1.0)
        assert learner.poll() is None, f"the learner died ({learner.returncode}):\n" + \
            learner.log.read_text()[-2000:]
        before = run.status()["received"]["a0"]
        run.wait(lambda: run.status()["received"]["a0"] > before + 50, 60, "the actor to go on acting")
        # even when the gate does abort (a lucky guess of its random counter), only it goes
        gates = _gate_pids(learner.pid)
        assert len(gates) == 1
        os.kill(gates[0], signal.SIGABRT)
        run.wait(lambda: run.status().get("wire_gate", {}).get("restarts", 0) >= 1, 30, "a new gate")
        assert run.status()["wire_gate"]["exits"][-1] == -signal.SIGABRT
        before = run.status()["received"]["a0"]
        run.wait(lambda: run.status()["received"]["a0"] > before + 50, 60, "the actor to act after it")
        assert learner.poll() is None
    finally:
        run.stop_all()
        ctx.destroy(0)


def test_crafted_routing_ids_leave_the_robot_driver_serving():
    """The actor side's one bound socket, the robot driver's, is behind a gate too: crafted ids,
    and a gate that aborts anyway, leave the driver (its robot safety loop) serving a client."""
    from envs.registry import make_env
    from envs.robot.driver import serve_in_thread

    server, thread = serve_in_thread({"name": "point_reach", "image_size": 16}, heartbeat_timeout=2.0)
    ctx = zmq.Context()
    try:
        port = int(server.endpoint.rsplit(":", 1)[1])
        env = make_env({"name": "robot", "port": port, "heartbeat_timeout": 2.0, "max_episode_steps": 3})
        env.reset(seed=0)
        routing_ids(ctx, [port], span=64, randoms=64, triggers=4)
        os.kill(server._gate.proc.pid, signal.SIGABRT)  # as if a guess had hit its counter
        deadline = time.monotonic() + 20
        while server._gate.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert thread.is_alive() and server._gate.restarts >= 1
        env.reset(seed=1)  # the client reconnects to the new gate and drives the env again
        env.step(env.action_space.sample())
        env.close()
    finally:
        ctx.destroy(0)
        server.shutdown()
        thread.join(10)
        server.close()


OWNER = """
import signal, sys, time
from data.core.gate import Front, Gate
g = Gate([Front("main")])
g.start()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print(g.proc.pid, flush=True)
while not stop:
    time.sleep(0.05)
end = time.monotonic() + 1.5   # a stopping server still polls its gate until it closes it
while time.monotonic() < end:
    g.poll()
    time.sleep(0.05)
print(g.restarts, g.exits, g.alive(), flush=True)
g.stop()
print(g.alive(), flush=True)
"""


def test_a_signal_to_the_servers_process_group_is_not_a_gate_death():
    """``kill -TERM -- -PGID`` (launch/gpu_box.sh stop, a terminal's job control) stops the
    server, which then stops its gate: the gate is not hit by the group's signal, so the server
    does not take its exit for a death and start a new gate while it stops."""
    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, start_new_session=True)
    try:
        gate_pid = int(p.stdout.readline())
        os.killpg(p.pid, signal.SIGTERM)
        stopping = p.stdout.readline()   # "restarts exits alive" while the server stops
        after = p.stdout.readline()      # alive after the server stopped it
        p.wait(20)
        assert stopping.split(" ", 1)[0] == "0", f"the gate was restarted during the stop: {stopping}"
        assert stopping.strip().endswith("True")   # untouched by the group's signal
        assert after.strip() == "False"
        assert _gone(gate_pid)
    finally:
        if p.poll() is None:
            p.kill()


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_killed_server_leaves_no_gate_behind():
    """The gate runs in a session of its own, so nothing signals it with its server: it ends
    by itself once its parent is gone."""
    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, start_new_session=True)
    gate_pid = 0
    try:
        gate_pid = int(p.stdout.readline())
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 15
        while not _gone(gate_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(gate_pid), "the gate outlived its killed server"
    finally:
        if p.poll() is None:
            p.kill()
        if gate_pid and not _gone(gate_pid):
            os.kill(gate_pid, signal.SIGKILL)
