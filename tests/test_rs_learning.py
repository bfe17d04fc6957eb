"""Rejection sampling learns, through the real learner and actor processes on loopback (CPU).

Task: ``env=point_reach``, its state-only variant (one task, a random target every episode,
the target's position in the state; no camera: the image variant is too slow to learn on
a shared CPU in a test's budget). Policy: the MLP (64x64, pre-tanh exploration std bounded to
[e^-3, e^-1]: a tanh-Gaussian fitted by NLL to its own samples otherwise inflates its variance,
and a lower bound of e^-5 makes the NLL of the saturated expert actions so steep that the fit
crawls). Demos: 5 scripted expert episodes (15 transitions) from
:func:`tools.record_demos.record_demos`; 30 BC steps on them make the deliberately weak
starting policy. Batches are 20% demos (``algo.demo_ratio=0.2``), lr 3e-3.

1. ``algo=rejection_sampling`` alone: success of the deterministic evaluation jobs (20 fixed
   init states) before (the pretrained version) and after a few cycles.
2. The same with ``intervention.device=expert`` correcting the first 25 episodes (a scripted
   person taking over when the policy drifts): the corrected steps reach the success store
   (counted in status.json) and success rises faster than in run 1 over the same number of
   cycles (same seeds, same demos).

Figures are printed (``pytest -s``); on a 2-core CPU with other work running, run 1 went
0.00 -> 0.50 (v5, 173 episodes, 117 s) and run 2 0.00 -> 0.85 (v3, 145 episodes, 25
corrected). The demos-only control (the same cycle, updates and demo batches, the online
successes unused), in an in-process replica of the cycle over 4 seeds: best 0.15-0.35, where
rejection sampling reached 0.25-0.50 (the MLP keeps learning from the 15 demo transitions, so
the control is not flat; the tiny PI0 gains far more: figures in agents/rs/agent.py).
Before this setting (std bound [e^-5, e^-1.5], lr 1e-3, demos 50%) run 1 reached only 0.25 on
CI, the same as its control.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_testutil import ROOT, free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "~env.cameras",
         "+env.cameras={}", "env.state_has_target=true"]
POLICY_O = ["policy=mlp", "policy.hidden_dims=[64,64]", "+policy.log_std_max=-1.0",
            "+policy.log_std_min=-3.0"]
ALGO_O = ["algo=rejection_sampling", "algo.pretrain_steps=30", "algo.env_steps_per_cycle=400",
          "algo.sft_steps_per_cycle=200", "algo.lr=3e-3", "algo.demo_ratio=0.2", "algo.eval_episodes=20", "algo.eval_tolerance=0.1"]


class RSRun:
    """A learner and one actor as processes; ``history()`` is the learner's evaluations."""

    def __init__(self, root: Path, name: str, demos: Path):
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.port, self.pub = free_port(), free_port()
        self.demos = demos
        self.procs: list[subprocess.Popen] = []
        self.t0 = time.monotonic()

    def _common(self) -> list[str]:
        return [*ENV_O, *POLICY_O, f"run_dir={self.dir}", f"transport.port={self.port}",
                f"transport.pub_port={self.pub}", "transport.timeout_s=2.0", "transport.heartbeat_s=0.5"]

    def _start(self, module: str, args: list[str], log: str) -> subprocess.Popen:
        f = open(self.dir / log, "ab")
        p = subprocess.Popen([sys.executable, "-m", module, *self._common(), *args], cwd=ROOT,
                             env=ENV, stdout=f, stderr=subprocess.STDOUT)
        p.log = self.dir / log
        self.procs.append(p)
        return p

    def learner(self, *extra, log="learner.log"):
        return self._start("learner", [*ALGO_O, f"buffer.demos={self.demos}", "device=cpu",
                                       "logging.wandb=disabled", "logging.every_s=1",
                                       "trainer.num_threads=1", "buffer.commit_interval_s=2", *extra], log)

    def actor(self, *extra):
        return self._start("actor", ["actor_id=a0", "spool.fsync=false", "log_every_s=5", "seed=0",
                                     *extra], "actor.log")

    def status(self) -> dict:
        try:
            return json.loads((self.dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def history(self) -> list[dict]:
        return self.status().get("replay", {}).get("rs", {}).get("history", [])

    def wait_evals(self, n: int, timeout: float, done=lambda hist: False) -> list[dict]:
        """Wait for ``n`` evaluations (or ``timeout``), or until ``done(history)`` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.history()) < n and not done(self.history()):
            for p in self.procs:
                if p.poll() not in (None, 0):
                    raise AssertionError(f"{p.log.name} exited {p.returncode}:\n{p.log.read_text()[-3000:]}")
            time.sleep(0.5)
        return self.history()

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.wall_s = time.monotonic() - self.t0

    def report(self, label: str) -> str:
        st = self.status()
        rep = st.get("replay", {})
        evals = ", ".join(f"v{h['version']}:{h['success']:.2f}" + ("" if h["decision"] in ("kept", "baseline")
                                                                 else "(rolled back)")
                          for h in self.history())
        return (f"\n{label}: evals [{evals}] | online episodes {rep.get('episodes')}, kept "
                f"{rep.get('kept_episodes')}, intervened steps {rep.get('intervened_steps')}, success "
                f"store {rep.get('success_store')} transitions ({rep.get('success_store_intervened')} "
                f"intervened) | updates {st.get('updates')} | env steps {st.get('env_steps')} | "
                f"wall {self.wall_s:.0f}s")


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from tools.record_demos import env_config, record_demos

    path = tmp_path_factory.mktemp("rs") / "demos"
    record_demos(env_config(ENV_O), path, 5, seed=1000)
    return path


def lifted(hist: list[dict]) -> bool:
    """What test_rejection_sampling_lifts_a_weak_bc_policy asserts of the evaluations: at least
    4 (the expert run compares cycles 1-3), and the best cycle 0.2 above the baseline and >= 0.3.
    More cycles can only raise the best, so the run may stop once this holds."""
    if len(hist) < 4:
        return False
    best = max(h["success"] for h in hist[1:])
    return best >= hist[0]["success"] + 0.2 and best >= 0.3


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, demos):
    """Run 1: rejection sampling alone, baseline + up to 6 cycles (or 150 s of evaluations),
    stopped early once the lift is there."""
    run = RSRun(tmp_path_factory.mktemp("rs"), "plain", demos)
    try:
        run.learner()
        run.actor()
        run.wait_evals(7, 150, done=lifted)
    finally:
        run.stop()
    return run


def test_rejection_sampling_lifts_a_weak_bc_policy(plain_run):
    hist = plain_run.history()
    print(plain_run.report("rejection sampling"))
    assert "Traceback" not in (plain_run.dir / "learner.log").read_text()
    assert len(hist) >= 4, hist
    base = hist[0]
    assert base["decision"] == "baseline" and base["episodes"] == 20 and base["version"] == 1
    best = max(h["success"] for h in hist[1:])
    st = plain_run.status()["replay"]
    assert st["kept_episodes"] > 0 and st["success_store"] > 0 and st["success_store_intervened"] == 0
    assert best >= base["success"] + 0.2 and best >= 0.3, hist


def test_expert_corrections_reach_the_store_and_speed_up_learning(tmp_path, demos, plain_run):
    run = RSRun(tmp_path, "expert", demos)
    try:
        run.learner()
        run.actor("intervention.device=expert", "intervention.expert.episodes=25")
        run.wait_evals(4, 150)
    finally:
        run.stop()
    print(plain_run.report("rejection sampling") + run.report("+ expert corrections (25 episodes)"))
    hist, plain = run.history(), plain_run.history()
    assert len(hist) >= 4 and len(plain) >= 4
    st = run.status()["replay"]
    # the corrected steps are in the success store, and only the first 25 episodes were touched
    assert 0 < st["intervened_episodes"] <= 25
    assert st["success_store_intervened"] == st["intervened_steps"] > 0
    # evaluation jobs were never corrected (skip_jobs): their successes are the policy's own
    assert hist[0]["success"] == plain[0]["success"]  # same demos, seeds, pretraining
    mean = lambda h: sum(x["success"] for x in h[1:4]) / 3  # noqa: E731 - first three cycles
    assert mean(hist) >= mean(plain) + 0.1, (hist, plain)
