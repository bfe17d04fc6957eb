"""launch/libero_two_gpu.sh and tools/libero_arms.py without a GPU, LIBERO or a learner.

The script runs for real down to the processes: launch/libero_chain.sh, launch/gpu_box.sh start /
stop and launch/run_learner.sh all run, with ``TANDEM_PYTHON`` a stand-in that records how it
was called, plays a learner (prints its serving line, leaves the metrics and status a test
wrote for that arm, waits for SIGTERM) or an actor (waits), and does nothing for the rest (the
demos and the SFT exist beforehand, as in tests/test_libero_pair_script.py). What must hold:
the arms run in order, each with its own learner command (arm one's learner sees GPU 0 alone;
arm a serves on cuda:1; arm b is a 2-process DeepSpeed launch with the float32 ZeRO-2 config),
the same actors (ids, settings, render GPU) in every arm, each arm's files land under its
name, and tools/libero_arms.py's figures are those this test computes from the files it wrote.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tools import libero_arms

ROOT = Path(__file__).resolve().parents[1]

FAKE = r"""#!/usr/bin/env bash
# a stand-in python: record the call; play a learner or an actor
echo "CVD=${CUDA_VISIBLE_DEVICES:-all} EGL=${MUJOCO_EGL_DEVICE_ID:-none} $*" >> "$FAKE_LOG"
case " $* " in
  *" -m learner "*|*" -m accelerate.commands.launch "*|*" -m torch.distributed.run "*)
    for a in "$@"; do case "$a" in run_dir=*) run="${a#run_dir=}" ;; esac; done
    arm=$(basename "$run")
    if [[ " $* " == *" mode=eval "* ]]; then echo '{"overall": {"success": 0.5}}' > "$run/eval_report.json"
    else cp "$FAKE_DIR/${arm}_metrics.jsonl" "$run/metrics.jsonl"; cp "$FAKE_DIR/${arm}_status.json" "$run/status.json"; fi
    echo "learner fake training on cuda:0, serving on cuda:0 at 127.0.0.1:5588"
    trap 'exit 0' TERM INT
    while true; do sleep 0.1; done ;;
  *" -m actor "*)
    trap 'echo "steps 9 | act 3.0 ms (run p50 2.0, p99 $FAKE_P99) | act failures 0"; exit 0' TERM INT
    while true; do sleep 0.1; done ;;
esac
exit 0
"""


def _arm_files(d: Path, arm: str, *, steps_per_s: float, updates_per_s: float, successes: list[float],
               interventions: list[int], p50: float, p99: float) -> None:
    """A metrics.jsonl with one line every 10 s and a final status.json, at the given rates."""
    rows = []
    for i, (s, iv) in enumerate(zip(successes, interventions)):
        t = 10.0 * i
        rows.append({"time": 1e9 + t, "wall_s": t, "step": int(updates_per_s * t), "updates": int(updates_per_s * t),
                     "env_steps": int(steps_per_s * t), "success": s, "interventions": iv, "version": i // 3,
                     "act_p50_ms": p50, "act_p99_ms": p99})
    (d / f"{arm}_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = rows[-1]
    (d / f"{arm}_status.json").write_text(json.dumps({**last, "act_p50_ms": p50, "act_p99_ms": p99,
                                                       "acts_timed": 1000, "episodes": 50}))


ARMS = {  # steps/s, updates/s, success (moving window) and interventions every 10 s, act p50/p99
    "one": dict(steps_per_s=100.0, updates_per_s=1.0, successes=[1.0, 1.0, 0.6, 0.5, 0.55, 0.6],
                interventions=[5, 3, 0, 0, 0, 0], p50=20.0, p99=80.0),
    "a": dict(steps_per_s=120.0, updates_per_s=1.5, successes=[1.0, 0.62, 0.6, 0.7, 0.7, 0.7],
              interventions=[4, 0, 0, 0, 0, 0], p50=12.0, p99=30.0),
    "b": dict(steps_per_s=110.0, updates_per_s=1.8, successes=[1.0, 1.0, 0.5, 0.55, 0.58, 0.59],
              interventions=[5, 2, 1, 0, 0, 0], p50=21.0, p99=90.0),
}


def _prepared(tmp_path: Path) -> tuple[Path, dict]:
    r = tmp_path / "lr"
    (r / "demos" / "meta").mkdir(parents=True)
    (r / "demos" / "meta" / "info.json").write_text("{}")
    (r / "sft").mkdir()
    (r / "sft" / "model.safetensors").write_bytes(b"")
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    for arm, kw in ARMS.items():
        _arm_files(fake_dir, arm, **kw)
    py = tmp_path / "python"
    py.write_text(FAKE)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env = {**env, "R": str(r), "TANDEM_PYTHON": str(py), "ARMS_PY": sys.executable, "GPU_LOG": "0",
           "FAKE_LOG": str(tmp_path / "calls.txt"), "FAKE_DIR": str(fake_dir), "FAKE_P99": "7.5",
           "N_RL": "2", "RS_S": "1", "TANDEM_STOP_WAIT_S": "20", "PYTHONPATH": str(ROOT)}
    return r, env


def test_the_arms_run_in_order_with_their_learners_and_the_same_actors(tmp_path):
    r, env = _prepared(tmp_path)
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_two_gpu.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr + (r / "chain_one.log").read_text()[-3000:]
    assert (r / "res" / "arms_done").read_text().split() == ["one=0", "a=0", "b=0"]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    learners = [c for c in calls if " -m actor " not in c and ("-m learner" in c or "launch" in c)]
    assert len(learners) == 3, calls
    one, a, b = learners
    assert one.startswith("CVD=0 ") and "inference.device" not in one and "gpus=1" in one
    assert a.startswith("CVD=all ") and "inference.device=cuda:1" in a and "gpus=1" in a
    assert b.startswith("CVD=all ") and "-m accelerate.commands.launch --num_processes 2" in b
    assert "--use_deepspeed --deepspeed_config_file config/deepspeed/zero2_fp32.json" in b
    assert "deepspeed.stage=2" in b and "gpus=2" in b
    for c in learners:   # the one-GPU run's RL settings in every arm
        assert "algo=rejection_sampling" in c and "algo.batch_size=256" in c and "algo.env_steps_per_cycle=1000" in c
        assert "algo.sft_steps_per_cycle=100" in c and "trainer.checkpoint_every_s=300" in c
    actors = [c for c in calls if " -m actor " in c]
    assert len(actors) == 6   # 2 per arm
    strip = [c.split(" run_dir=")[0] + " " + c.split(" run_dir=")[1].split(" ", 1)[1] for c in actors]
    assert sorted(strip[0:2]) == sorted(strip[2:4]) == sorted(strip[4:6]), strip   # the same actors, run_dir aside
    assert all(c.startswith("CVD=all EGL=0 ") for c in actors)
    assert "intervention.device=expert" in actors[0] and "intervention.expert.episodes=6" in actors[0]
    for arm in ARMS:
        for f in ("metrics.jsonl", "status.json", "actor_lines.txt", "learner.log"):
            assert (r / "res" / f"{arm}_{f}").exists(), (arm, f)
    timeline = (r / "res" / "timeline.txt").read_text()
    assert timeline.index("arm one:") < timeline.index("arm a:") < timeline.index("arm b:")
    assert "learner GPUs 0" in timeline and "inference.device=cuda:1" in timeline

    result = json.loads((r / "res" / "arms.json").read_text())
    figs = {f["arm"]: f for f in result["arms"]}
    # the target: arm one's last success (0.6) with at most its last interventions (0)
    assert result["baseline"] == "one" and result["target_success"] == 0.6 and result["target_max_interventions"] == 0
    assert figs["one"]["time_to_target_s"] == 20.0     # 1.0 at 0 s and 10 s came with the expert's corrections
    assert figs["a"]["time_to_target_s"] == 10.0      # 0.62 with no correction left
    assert figs["b"]["time_to_target_s"] is None       # 0.59 at the end: never
    for arm, kw in ARMS.items():
        f = figs[arm]
        assert f["env_steps_per_s"] == pytest.approx(kw["steps_per_s"], rel=0.01)
        assert f["updates_per_s"] == pytest.approx(kw["updates_per_s"], rel=0.01)
        assert f["act_p50_ms"] == kw["p50"] and f["act_p99_ms"] == kw["p99"]
        assert f["actor_round_trip"] == {"actors": 2, "round_trip_p50_ms_median": 2.0, "round_trip_p99_ms_max": 7.5}
    assert figs["a"]["env_steps_vs_baseline"] == pytest.approx(1.2, rel=0.01)
    md = (r / "res" / "arms.md").read_text()
    assert "| a | train GPU 0, serve GPU 1 |" in md and "(1.20x)" in md


def test_the_protocol_after_an_arm_runs_on_one_gpu(tmp_path):
    """AFTER=1: arm b's RL learner is a 2-rank launch, its protocol-after sweep one process (an
    evaluation refuses gpus=2): the arm's overrides reach its RL learner alone."""
    r, env = _prepared(tmp_path)
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_two_gpu.sh")], cwd=ROOT,
                         env={**env, "ARMS": "b", "AFTER": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr + (r / "chain_b.log").read_text()[-3000:]
    calls = [c for c in (tmp_path / "calls.txt").read_text().splitlines() if " -m actor " not in c and "learner" in c]
    assert len(calls) == 2, calls
    rl, sweep = calls
    assert "gpus=2" in rl and "deepspeed.stage=2" in rl and "mode=eval" not in rl
    assert "mode=eval" in sweep and "gpus=1" in sweep and "deepspeed" not in sweep and "accelerate" not in sweep
    assert json.loads((r / "res" / "eval_after_b.json").read_text()) == {"overall": {"success": 0.5}}


def test_arms_stop_without_the_kit_and_refuse_an_odd_batch_for_arm_b(tmp_path):
    r, env = _prepared(tmp_path)
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_two_gpu.sh")], cwd=ROOT,
                         env={**env, "TANDEM_PYTHON": "false"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "kit check failed" in out.stderr, out.stdout + out.stderr
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_two_gpu.sh")], cwd=ROOT,
                         env={**env, "BATCH": "255"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "make it even" in out.stderr, out.stderr
    assert not (r / "res" / "arms_done").exists()


def test_libero_arms_reads_gpu_logs_and_skips_missing_arms(tmp_path):
    res = tmp_path / "res"
    res.mkdir()
    _arm_files(res, "one", **ARMS["one"])
    (res / "one_gpu.csv").write_text("2026/11/28 10:00:00.000, 0, 80 %, 1000 MiB\n"
                                     "2026/11/28 10:00:05.000, 1, 0 %, 10 MiB\n"
                                     "2026/11/28 10:00:05.000, 0, 90 %, 3000 MiB\n"
                                     "garbage line\n")
    result = libero_arms.main(["--res", str(res), "--arms", "one", "a"])
    f = result["arms"][0]
    assert f["gpu"] == {"util_mean_pct": {"0": 85.0, "1": 0.0}, "samples": {"0": 2, "1": 1}, "memory_max_mib": 3000.0}
    assert result["missing_arms"] == ["a"] and f["actor_round_trip"] is None
    assert "0: 85 / 1: 0" in (res / "arms.md").read_text()


def test_run_learner_takes_another_deepspeed_config_and_refuses_a_missing_one(tmp_path):
    echo = tmp_path / "python"
    echo.write_text('#!/usr/bin/env bash\necho "$*"\n')
    echo.chmod(echo.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "TANDEM_PYTHON": str(echo)}
    run = lambda *a: subprocess.run(["bash", str(ROOT / "launch" / "run_learner.sh"), *a], cwd=ROOT, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=30)
    out = run("--gpus", "2", "deepspeed.stage=2", "deepspeed.config=config/deepspeed/zero2_fp32.json")
    assert out.returncode == 0 and "--deepspeed_config_file config/deepspeed/zero2_fp32.json" in out.stdout
    assert json.loads((ROOT / "config/deepspeed/zero2_fp32.json").read_text())["bf16"]["enabled"] is False
    out = run("--gpus", "2", "deepspeed.stage=2")
    assert "--deepspeed_config_file config/deepspeed/zero2.json" in out.stdout
    out = run("--gpus", "2", "deepspeed.stage=2", "deepspeed.config=nowhere.json")
    assert out.returncode == 2 and "no such file" in out.stderr


# -- the whole script for real on a CPU at toy size --------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("TANDEM_FAULT_TESTS"),
                    reason="a 5-minute run on 2 cores (LIBERO, three learners, one of 2 ranks): TANDEM_FAULT_TESTS=1")
def test_the_arms_for_real_on_a_cpu_at_toy_size(tmp_path):
    """The script with the real learner, actor, LIBERO and tiny PI0 on a CPU: demos, SFT, then each
    arm's RL for 40 s with CPU stand-ins for the GPUs (arm a: inference.device=cpu; arm b: 2 gloo
    ranks, DDP); every arm trains, publishes and checkpoints, arm b's rank 1 makes every update,
    and the comparison reads the real files."""
    from test_envs_libero import _assets_available

    from learner.checkpoint import latest_checkpoint, load_checkpoint
    from tools.make_tiny_checkpoints import TINY_PI0_ARCH

    if not _assets_available():
        pytest.skip("no LIBERO assets (see envs/libero/assets.py)")
    arch = "{" + ",".join(f"{k}:{v}" for k, v in dict(TINY_PI0_ARCH, vision_patch=8).items()) + "}"
    r = tmp_path / "lr"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(R=str(r), TANDEM_PYTHON=sys.executable, ARMS_PY=sys.executable, GPU_LOG="0", TASKS="0", IMAGE="32",
               K="1", STEPS="3", N_RL="1", BATCH="4", CYCLE_STEPS="16", CYCLE_SFT="2", RS_S="40", WORKERS="1",
               EXTRA_ENV="env.max_episode_steps=12",
               EXTRA_POL=f"policy.arch={arch} policy.image_size=32 policy.chunk_size=5 policy.fast_warmup_buckets=[]",
               EXTRA_LRN="trainer.num_threads=1 logging.every_s=2", GPU_ONE="", LRN_A="inference.device=cpu",
               LRN_B="gpus=2 device=cpu", TANDEM_RDZV_PORT=str(_free_port()))
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_two_gpu.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=880)
    logs = "".join(p.read_text()[-2000:] for p in sorted(r.glob("chain_*.log")))
    assert out.returncode == 0, out.stdout + out.stderr + logs
    result = json.loads((r / "res" / "arms.json").read_text())
    print("\n" + (r / "res" / "arms.md").read_text())
    assert [f["arm"] for f in result["arms"]] == ["one", "a", "b"]
    for f in result["arms"]:
        st = json.loads((r / "res" / f"{f['arm']}_status.json").read_text())
        assert st["updates"] >= 2 and st["version"] >= 1, (f["arm"], st["updates"], st["version"])
        assert f["env_steps_per_s"] > 0 and f["act_p50_ms"] <= f["act_p99_ms"], f
        assert f["actor_round_trip"]["actors"] == 1, f
        state = load_checkpoint(latest_checkpoint(r / f["arm"] / "checkpoints"))
        assert state["ranks"]["world"] == (2 if f["arm"] == "b" else 1)
    rank1 = json.loads((r / "b" / "rank1.json").read_text())
    assert rank1["updates"] == json.loads((r / "res" / "b_status.json").read_text())["updates"]


def _free_port() -> int:
    from tandem_testutil import free_port

    return free_port()


def test_time_to_target_ignores_windows_still_filling_with_the_experts_corrections():
    """The 2-GPU run's own files (docs/libero/two_gpu): 10 s into arms a and b the windows held
    3-9 episodes, every one corrected by the expert (success 1.0, no more corrected episodes than
    arm one's final 9); those lines are not the policy's success. Counted from the corrected
    episodes' peak, a never reaches one's final 0.53 (it ends at 0.50) and b reaches it at the end."""
    res = ROOT / "docs" / "libero" / "two_gpu"
    rows = {a: libero_arms.read_metrics(res / f"{a}_metrics.jsonl") for a in ("one", "a", "b")}
    early = [r for r in rows["a"] if r.get("success") is not None][0]
    assert early["wall_s"] < 15 and early["success"] == 1.0 and early["interventions"] <= 9
    result = libero_arms.compare(res, ["one", "a", "b"])
    figs = {f["arm"]: f for f in result["arms"]}
    assert result["target_success"] == 0.53 and result["target_max_interventions"] == 9
    assert figs["one"]["time_to_target_s"] == figs["one"]["wall_s"]
    assert figs["a"]["time_to_target_s"] is None
    assert figs["b"]["time_to_target_s"] > 200
    # the rule on made-up rows: a 1.0 while the windows fill does not count; after the peak it does
    mk = lambda pairs: [{"wall_s": 10.0 * i, "success": s, "interventions": iv} for i, (s, iv) in enumerate(pairs)]  # noqa: E731
    assert libero_arms.time_to(mk([(1.0, 2), (1.0, 8), (0.7, 3), (0.6, 1)]), 0.6, 2) == 30.0
    assert libero_arms.time_to(mk([(0.5, 0), (0.6, 0)]), 0.6, 0) == 10.0   # no corrections at all
