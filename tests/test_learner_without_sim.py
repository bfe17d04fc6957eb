"""The learner box needs no simulator: ``python -m learner env=libero_spatial`` starts, serves
and stops with MuJoCo, robosuite, LIBERO and gym-hil made unimportable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tandem_testutil import ROOT, free_port, import_blocker

pytestmark = pytest.mark.slow

BLOCKED = ("mujoco", "robosuite", "libero", "gym_hil", "bddl", "gymnasium.envs.mujoco")

# Runs after tandem_testutil.import_blocker's prelude: imports of blocked modules fail, and are noted.
RUNNER = """
import atexit, json, runpy
atexit.register(lambda: open({out!r}, "w").write(json.dumps(
    {{"tried": tried, "loaded": blocked_loaded()}})))
sys.argv = ["learner", *{args!r}]
runpy.run_module("learner", run_name="__main__")
"""


def test_learner_starts_env_libero_spatial_without_simulators(tmp_path):
    run = tmp_path / "run"
    out = tmp_path / "imports.json"
    args = ["env=libero_spatial", "policy=mlp", f"run_dir={run}", f"transport.port={free_port()}",
            f"transport.pub_port={free_port()}", "logging.wandb=disabled", "logging.every_s=0.5",
            "buffer.persist=false", "buffer.capacity=1000", "trainer.num_threads=1"]
    code = import_blocker(BLOCKED) + RUNNER.format(out=str(out), args=args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "learner.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=f,
                             stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            status = {}
            while time.monotonic() < deadline and p.poll() is None:
                try:
                    status = json.loads((run / "status.json").read_text())
                    break
                except (FileNotFoundError, json.JSONDecodeError):
                    time.sleep(0.2)
            assert p.poll() is None, f"learner exited early:\n{log.read_text()}"
            assert status.get("port"), f"no status.json after 120 s:\n{log.read_text()}"
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=60) == 0, log.read_text()
        finally:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    assert "serving" in text and "env=libero_spatial" in text, text
    imports = json.loads(out.read_text())
    assert imports == {"tried": [], "loaded": []}, imports
