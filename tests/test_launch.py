"""The foreground launcher: learner + actor start, and everything stops cleanly, both when
the learner ends the run and on Ctrl-C (SIGINT to the process group)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tandem_testutil import ROOT, free_port

pytestmark = pytest.mark.slow


def _launch(tmp_path, *extra):
    env = {**os.environ, "TANDEM_PYTHON": sys.executable, "WANDB_MODE": "disabled"}
    args = ["bash", str(ROOT / "launch" / "run_local.sh"), "--actors", "1", f"run_dir={tmp_path}/run",
            f"transport.port={free_port()}", f"transport.pub_port={free_port()}",
            "learner:logging.wandb=disabled", "learner:algo.learning_starts=100",
            "learner:logging.every_s=1", "actor:spool.fsync=false", *extra]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)


def _no_leftovers(tmp_path):
    out = subprocess.run(["pgrep", "-f", f"run_dir={tmp_path}/run"], capture_output=True, text=True)
    return out.stdout.strip() == ""


def test_learner_ending_the_run_stops_the_actors(tmp_path):
    p = _launch(tmp_path, "learner:trainer.max_updates=30")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    assert "[learner]" in out and "[actor-0]" in out and "connected to learner" in out
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
    time.sleep(0.5)
    assert _no_leftovers(tmp_path)


def test_ctrl_c_stops_everything(tmp_path):
    p = _launch(tmp_path)
    deadline = time.monotonic() + 180
    while not (tmp_path / "run" / "status.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out, out[-3000:]
    time.sleep(0.5)
    assert _no_leftovers(tmp_path)
