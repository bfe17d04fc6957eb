"""LIBERO for real, end to end on a CPU at toy size: scripted expert -> demos -> SFT of a PI0
trained from scratch -> an evaluation sweep through a real learner and actor -> two
rejection-sampling rounds through a real learner and actor, each stage fed by the last.

It checks that every stage runs and hands the next what it needs (a dataset, a checkpoint, a
report, published versions the actor acts with), not that success rises: the GPU box runs
that (docs/libero.md). libero_spatial task 0, 32x32 cameras, a PI0 of the tiny
test sizes built from scratch (``policy=pi0_small`` with a tiny ``arch``), the fast render.
Skipped without
LIBERO's assets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tandem_testutil import free_port
from test_envs_libero import _assets_available
from tools.experiments.learning_run import stop_processes
from tools.make_tiny_checkpoints import TINY_PI0_ARCH

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not _assets_available(), reason="no LIBERO assets (see envs/libero/assets.py)")

ARCH = "{" + ", ".join(f"{k}: {v}" for k, v in dict(TINY_PI0_ARCH, vision_patch=8).items()) + "}"
# render_quality=fast (no MSAA, reflections or shadows): 120 ms a step here instead of 290 ms
# (2-core VM); what the chain checks is the hand-over, and tests/test_envs_libero.py renders
# LIBERO's faithful look
ENV = ["env=libero_spatial", "env.task_id=0", "env.image_size=32", "env.render_quality=fast"]
POLICY = ["policy=pi0_small", f"policy.arch={ARCH}", "policy.image_size=32", "policy.chunk_size=4",
          "policy.fast_warmup_buckets=[]"]


def test_expert_solves_fixed_and_sampled_starts_and_stands_in_for_a_person():
    from envs.intervention.expert import ExpertIntervention
    from envs.libero.env import LiberoEnv

    env = LiberoEnv("libero_spatial", 0, init_state_id=None, cameras={})
    try:
        for options in ({"init_state": 0}, {"init_state": 7}, None):
            if options is None:
                env.init_state_id = "random"
            env.reset(seed=3, options=options)
            done, t = False, 0
            while not done and t < 220:
                _, _, done, _, info = env.step(env.expert_action())
                t += 1
            assert done and info["is_success"], f"the expert failed from {options}"
        # sampled placements of objects on fixtures land on them (a soft reset would drop the
        # bowl from the stove's old pose)
        stove = LiberoEnv("libero_spatial", 7, init_state_id="random", cameras={})
        try:
            for seed in (0, 1):
                stove.reset(seed=seed)
                inner = stove._env.env
                bowl = inner.sim.data.body_xpos[inner.obj_body_id["akita_black_bowl_1"]]
                cook = inner.sim.data.get_site_xpos("flat_stove_1_cook_region")
                assert np.linalg.norm(bowl[:2] - cook[:2]) < 0.06 and bowl[2] > 0.85, (bowl, cook)
        finally:
            stove.close()
        # as a corrector: a policy heading away from the bowl is taken over and the task solved
        env.init_state_id = 0
        person = ExpertIntervention(trigger="drift", drift_steps=2, drift_threshold=0.5)
        tapped = person.bind(env)
        tapped.reset(seed=0)
        done, t, took = False, 0, 0
        away = np.array([-1.0, 0, 1.0, 0, 0, 0, -1.0], np.float32)
        while not done and t < 220:
            state = person.poll(t)          # as the actor does: poll, then step what is chosen
            took += bool(state.active)
            _, _, done, _, _ = tapped.step(state.action if state.active else away)
            t += 1
        assert done and person.takeovers >= 1 and took > 10
    finally:
        env.close()


def _start(args, log: Path, env):
    f = open(log, "ab")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait(procs, cond, timeout, what, logs):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"a process exited {p.returncode} waiting for {what}:\n" +
                                     "\n".join(f"--- {x.name}\n{x.read_text()[-2500:]}" for x in logs))
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n" +
                         "\n".join(f"--- {x.name}\n{x.read_text()[-2500:]}" for x in logs))


def test_expert_demos_sft_eval_and_two_rl_rounds_hand_over(tmp_path):
    from tools import sft
    from tools.experiments.learning_run import version_success
    from tools.record_demos import env_config, record_demos

    # 1. the expert's demos, from sampled placements (none of the evaluation states)
    demos = tmp_path / "demos"
    summary = record_demos(env_config([*ENV, "env.init_state_id=random"]), demos, 2, seed=1000,
                           only_success=True)
    assert summary["episodes"] == 2 and summary["successes"] == 2

    # 2. SFT of a PI0 built from scratch, written as a checkpoint
    ckpt = tmp_path / "sft"
    rep = sft.main(["--demos", str(demos), "--save-checkpoint", str(ckpt), "--steps", "3", "--batch-size", "4",
                    *ENV, *POLICY])
    assert (ckpt / "model.safetensors").exists() and (ckpt / "tokenizer").is_dir()
    assert rep["trained_parameters"] == rep["parameters"] and np.isfinite(rep["loss_last"])

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    loaded = [*ENV, *POLICY, f"policy.checkpoint={ckpt}"]

    def common(run):
        return [f"run_dir={run}", f"transport.port={free_port()}", "transport.timeout_s=2.0",
                "transport.heartbeat_s=0.5"]

    # 3. an evaluation sweep (LIBERO's protocol, 2 init states) through a learner and an actor
    run = tmp_path / "eval"
    run.mkdir()
    c = common(run)
    c.append(f"transport.pub_port={free_port()}")
    logs = [run / "learner.log", run / "actor.log"]
    procs = [_start(["-m", "learner", *loaded, *c, "mode=eval", "algo=rejection_sampling", "eval.sweep={task_ids: [0], init_states: 2}",
                     "logging.wandb=disabled", "trainer.num_threads=1", "env.max_episode_steps=8"],
                    logs[0], env)]
    procs.append(_start(["-m", "actor", *loaded, *c, "actor_id=a0", "spool.fsync=false", "chunk.execute=4",
                         "env.max_episode_steps=8"], logs[1], env))
    try:
        _wait(procs, lambda: (run / "eval_report.json").exists(), 300, "the evaluation report", logs)
    finally:
        stop_processes(procs, 60)
    report = json.loads((run / "eval_report.json").read_text())
    assert report["overall"]["episodes"] == 2 and report["overall"]["jobs"] == 2

    # 4. two rejection-sampling rounds from the SFT checkpoint, demos mixed in
    run = tmp_path / "rl"
    run.mkdir()
    c = common(run)
    c.append(f"transport.pub_port={free_port()}")
    logs = [run / "learner.log", run / "actor.log"]
    procs = [_start(["-m", "learner", *loaded, *c, "algo=rejection_sampling", f"buffer.demos={demos}",
                     "algo.env_steps_per_cycle=8", "algo.sft_steps_per_cycle=2", "algo.batch_size=4",
                     "algo.eval_episodes=0", "trainer.max_updates=4", "buffer.video=false",
                     "buffer.commit_interval_s=1", "logging.wandb=disabled", "trainer.num_threads=1",
                     "env.max_episode_steps=8"],
                    logs[0], env)]
    procs.append(_start(["-m", "actor", *loaded, *c, "actor_id=a0", "spool.fsync=false", "chunk.execute=4",
                         "env.init_state_id=random", "env.max_episode_steps=8"], logs[1], env))
    try:
        _wait(procs, lambda: procs[0].poll() is not None, 400, "the learner to stop at 4 updates", logs)
    finally:
        stop_processes(procs, 60)
    status = json.loads((run / "status.json").read_text())
    assert status["updates"] >= 4 and status["version"] >= 2
    by_version = version_success(run / "dataset")
    assert sum(len(v) for v in by_version.values()) >= 2
    assert max(by_version) >= 1, "the actor never acted with a trained version"
    assert any((run / "checkpoints").rglob("*")), "no checkpoint written"
