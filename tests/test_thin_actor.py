"""The thin actor install (issue 27): ``uv sync --frozen --no-default-groups`` gives an
environment with the project's base dependencies only (numpy, pyzmq, msgpack, hydra/omegaconf,
gymnasium): no torch, no simulator, no learner stack. It is built here from the lock, offline
from the local uv cache, and an actor from it (``mode=remote env=robot``) drives a robot driver
(the reference one, serving ``point_reach``, also from the thin environment) and streams to a
real learner (from the full environment) on loopback until every record is acknowledged."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_testutil import ROOT, free_port

# what a thin install must not have (the base dependencies pull none of them)
ABSENT = ("torch", "mujoco", "lerobot", "transformers", "deepspeed", "gym_hil", "libero", "wandb",
          "rerun", "rich")
CAMERA = 16  # point_reach's one camera, observation.images.image [16, 16, 3]
SPEC = (f"env.spec={{state_dim:2,action_dim:2,cameras:{{image:[{CAMERA},{CAMERA},3]}},"
        "has_task:true,default_max_episode_steps:30}")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def thin(tmp_path_factory) -> Path:
    """The thin environment's python (``uv sync --frozen --no-default-groups --offline``)."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    venv = tmp_path_factory.mktemp("thin") / "venv"
    env = {k: v for k, v in ENV.items() if k != "VIRTUAL_ENV"}
    env.update(UV_PROJECT_ENVIRONMENT=str(venv), UV_PYTHON=sys._base_executable,
               UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    t0 = time.monotonic()
    out = subprocess.run([uv, "sync", "--frozen", "--no-default-groups", "--offline"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    if out.returncode != 0:
        if "Network connectivity is disabled" in out.stderr:  # uv's words for a cache miss offline
            pytest.skip(f"the uv cache lacks a package of the thin set:\n{out.stderr[-1500:]}")
        raise AssertionError(f"uv sync of the thin set failed:\n{out.stderr[-3000:]}")
    size = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()[0]
    print(f"\nthin install: {took:.1f} s, {size} MB ({venv})")
    return venv / "bin" / "python"


def test_thin_install_lacks_torch_simulators_and_the_learner_stack(thin):
    code = ("import importlib.util, json; print(json.dumps([m for m in "
            f"{ABSENT!r} if importlib.util.find_spec(m)]))")
    out = subprocess.run([str(thin), "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    gone = subprocess.run([str(thin), "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "No module named 'torch'" in gone.stderr


def test_thin_actor_mode_local_names_the_group_it_needs(thin, tmp_path):
    out = subprocess.run([str(thin), "-m", "actor", "mode=local", "env=robot", SPEC,
                          f"run_dir={tmp_path}"], cwd=tmp_path, env=ENV, capture_output=True,
                         text=True, timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "mode=local" in text and "needs torch" in text
    assert "uv sync --frozen --no-default-groups --group local-policy" in text


def test_live_view_without_rich_keeps_plain_lines(monkeypatch, caplog):
    """rich is only the live panel: without it (a thin install) a terminal gets the plain lines."""
    from actor.console import LiveView

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    for mod in ("rich", "rich.console", "rich.live"):
        monkeypatch.setitem(sys.modules, mod, None)  # importing it raises ImportError
    with caplog.at_level(logging.INFO, logger="tandem"):
        view = LiveView(lambda: "status").start()
    assert not view.active and "rich is not installed" in caplog.text
    view.stop()


def _wait_line(proc: subprocess.Popen, word: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if word in line or not line:
            return line
    return ""


def _status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_thin_actor_drives_a_robot_and_streams_to_a_full_learner(thin, tmp_path):
    run = tmp_path / "run"
    port, pub, act, robot = free_port(), free_port(), free_port(), free_port()
    learner_log = tmp_path / "learner.log"
    procs = []
    try:
        with open(learner_log, "wb") as f:  # the learner: the full environment (this one)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "learner", "env=robot", SPEC, "policy=mlp", f"run_dir={run}",
                 f"transport.port={port}", f"transport.pub_port={pub}", f"transport.act_port={act}",
                 "logging.wandb=disabled", "logging.every_s=0.5", "trainer.num_threads=1",
                 "algo.learning_starts=50", "buffer.video=false"],
                cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT))
        driver = subprocess.Popen(  # the robot box's driver, from the thin environment too
            [str(thin), "-m", "envs.robot.driver", "--env", "point_reach", "--set",
             f"image_size={CAMERA}", "--port", str(robot), "--log-level", "WARNING"],
            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(driver)
        assert "ready" in _wait_line(driver, "ready", 60), "the robot driver did not start"
        deadline = time.monotonic() + 120
        while not (run / "status.json").exists():
            assert procs[0].poll() is None, learner_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no learner after 120 s:\n" + learner_log.read_text()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        actor = subprocess.run(
            [str(thin), "-m", "actor", "mode=remote", "env=robot", f"env.port={robot}", "actor_id=thin-0",
             f"run_dir={run}", f"transport.port={port}", f"transport.pub_port={pub}",
             "max_episodes=3", "spool.fsync=false", "log_every_s=1", "drain_s=60"],
            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180)
        text = actor.stdout + actor.stderr
        assert actor.returncode == 0, text[-3000:] + "\n--- learner\n" + learner_log.read_text()[-2000:]
        assert "connected to learner" in text
        spool = run / "spool" / "thin-0"
        meta = json.loads((spool / "meta.json").read_text())
        assert meta["next_episode"] == 3 and meta["next_seq"] > 3
        assert not list(spool.glob("*.msg")), "the actor exited with records unacknowledged"
        deadline = time.monotonic() + 10  # status.json is rewritten every logging tick
        while (status := _status(run)).get("received", {}).get("thin-0") != meta["next_seq"] - 1 \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status["received"]["thin-0"] == meta["next_seq"] - 1, status
        print(f"\nthin actor: {meta['next_seq']} records in 3 episodes, acknowledged, "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        _stop(procs)
