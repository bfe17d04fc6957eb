"""tools/bench/train_serve.py: training while serving, against each alone (issue: one GPU that
serves and trains). The default suite checks the trace summary; the CPU run of the whole bench
(tiny PI0, real actor processes over loopback) is behind TANDEM_BENCH_TESTS=1 (~70 s)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tools.bench.train_serve import main
from tools.bench.train_serve_parts import GilProbe, stream_overlap
from tools.bench.train_serve_loads import env_config, execute_for, key_values, load_key, parse_loads


def _kernel(stream, ts_us, dur_us):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts_us, "dur": dur_us, "args": {"stream": stream}}


def test_stream_overlap_counts_kernel_time_per_stream_and_the_time_two_ran_at_once():
    trace = {"traceEvents": [
        _kernel(7, 0, 100), _kernel(7, 50, 100),      # stream 7 busy 0-150 us (overlapping kernels merged)
        _kernel(13, 120, 80),                         # stream 13 busy 120-200: 30 us together with 7
        _kernel(13, 400, 10),                         # alone
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not a kernel
    ]}
    s = stream_overlap(trace)
    assert s["streams"] == 2
    assert s["kernel_s_by_stream"]["7"] == pytest.approx(150e-6)
    assert s["kernel_s_by_stream"]["13"] == pytest.approx(90e-6)
    assert s["overlap_s"] == pytest.approx(30e-6)
    assert stream_overlap({"traceEvents": []}) == {"kernel_s_by_stream": {}, "overlap_s": 0.0, "streams": 0}


bench = pytest.mark.skipif(not os.environ.get("TANDEM_BENCH_TESTS"), reason="set TANDEM_BENCH_TESTS=1 (~70 s)")


@bench
def test_gil_probe_sees_a_thread_that_holds_the_interpreter():
    def late_p99(busy: bool) -> float:
        probe = GilProbe()
        probe.start()
        t_end = time.perf_counter() + 0.5
        while time.perf_counter() < t_end:
            if busy:
                sum(range(2000))      # pure Python: holds the GIL for a switch interval at a time
            else:
                time.sleep(0.01)
        return probe.finish()["p99"]
    idle, busy = late_p99(False), late_p99(True)
    assert busy > 2.0 and busy > 3 * idle, (idle, busy)


@bench
def test_train_serve_runs_every_phase_on_the_cpu(tmp_path):
    out = main(["--tiny", "--device", "cpu", "--policies", "pi0", "--actors", "2", "--seconds", "2",
                "--repeats", "1", "--streams", "shared,window:3", "--train-batch", "2", "--image-size", "32",
                "--trace", str(tmp_path / "trace"), "--json", str(tmp_path / "out.json")])
    r = out["policies"]["pi0"]
    phases = {x["phase"]: x for x in r["runs"] if x["stream"] == "shared"}
    win = {x["phase"]: x for x in r["runs"] if x["stream"] == "window:3"}
    assert "window" not in phases["both"]                   # shared: no window
    assert win["both"]["window"]["windows"] > 0 and win["both"]["window"]["waits"] > 0
    assert win["both"]["window"]["lead"] == 3
    assert win["both"]["act"]["chunks_per_s"] > 0 and win["both"]["train"]["updates"] > 0
    assert set(phases) == {"serve", "train", "both", "both_traced"}
    assert phases["train"]["train"]["updates"] > 0 and "act" not in phases["train"]
    assert phases["serve"]["act"]["chunks_per_s"] > 0 and "train" not in phases["serve"]
    both = phases["both"]
    assert both["train"]["updates"] > 0 and both["act"]["chunks_per_s"] > 0
    # the server's record of the phase holds exactly the actors' timed requests
    srv = both["act"]["server"]
    assert sum(int(b) * c for b, c in srv["batch_sizes"].items()) == round(both["act"]["chunks_per_s"] * 2)
    assert 0 < srv["forward_p50_ms"] <= srv["forward_p99_ms"] <= srv["forward_max_ms"] <= both["act"]["max_ms"]
    assert both["cpu"].get("tandem-inference", 0) > 0 and both["cpu"].get("MainThread", 0) > 0
    assert (tmp_path / "trace" / "pi0_shared_a2_p0.json").exists()
    s = r["by_period"]["0"]["shared"]
    assert s["update_ratio"] == pytest.approx(s["updates_per_s_both"] / s["updates_per_s_train"])
    assert s["step_ratio"] == pytest.approx(s["step_p50_ms_train"] / s["step_p50_ms_both"])
    assert s["update_ratio_judged"] == min(s["update_ratio"], s["step_ratio"])
    assert s["meets_targets"] == (s["update_ratio_judged"] >= 0.8 and s["act_p99_ratio"] <= 1.3)
    assert json.loads((tmp_path / "out.json").read_text())["policies"]["pi0"]["by_period"]["0"]["shared"]
    assert threading.active_count() < 10   # the learners' threads ended


def test_grpo_trainer_runs_grpo_rounds_on_the_discrete_oft(tmp_path):
    """--update grpo (auto for openvla_oft_discrete): each step is a real GRPOAgent update round
    over chunks the policy sampled, with behaviour log-probs and +-1 advantages; the trainable
    weights move and a new version is published on the cadence."""
    import torch

    from tools.bench.common import bench_spec
    from tools.bench.policy import build
    from tools.bench.train_serve_parts import Trainer, update_for

    assert update_for("openvla_oft_discrete", "auto") == "grpo" and update_for("pi0", "auto") == "bc"
    spec = bench_spec(8, 7, ["image", "wrist_image"], 32, has_task=True)
    policy, _ = build("openvla_oft_discrete", True, "cpu", tmp_path, spec)
    published = []
    trainer = Trainer(policy, spec, 4, published.append, 2, lambda: None, update="grpo", minibatch=2)
    b = trainer.batch
    assert b["action"].shape == (4, policy.chunk_size, spec.action_dim) and b["old_log_prob"].shape == (4,)
    assert b["advantages"].tolist() == [1.0, -1.0, 1.0, -1.0]
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    for _ in range(2):
        assert trainer.step() > 0
    assert trainer.agent.num_updates == 2 and len(published) == 1
    assert trainer.agent.cfg.minibatch_size == 2  # two optimizer steps a round
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="--update"):
        Trainer(policy, spec, 4, published.append, 2, lambda: None, update="ppo")


def test_loads_name_seconds_or_simulated_actors_and_refuse_anything_else():
    assert parse_loads("0.5, 0,sim") == [0.5, 0.0, "sim"]
    assert [load_key(x) for x in parse_loads("0.5,0,sim")] == ["0.5", "0", "sim"]
    with pytest.raises(SystemExit, match="'simulated' is neither"):
        parse_loads("0.5,simulated")
    with pytest.raises(SystemExit, match="need --env"):
        main(["--period", "sim", "--tiny", "--device", "cpu", "--json", "-"])


def test_simulated_actors_run_pi0_s_replanning_and_the_env_config_takes_yaml_values():
    class Chunk:
        chunk_size = 50
    assert execute_for("pi0", Chunk, 0) == 5 and execute_for("pi05", Chunk, 0) == 5
    assert execute_for("openvla_oft_discrete", Chunk, 0) == 0 and execute_for("pi0", Chunk, 8) == 8

    class Args:
        env, image_size, env_set = "libero_spatial", 224, ["gl=egl", "task_id=all", "num_steps_wait=3"]
    assert env_config(Args) == {"name": "libero_spatial", "image_size": 224, "gl": "egl", "task_id": "all",
                                "num_steps_wait": 3}
    Args.env_set = ["gl"]
    with pytest.raises(SystemExit, match="'gl': expected key=value"):
        env_config(Args)
    assert key_values(["fast_llm_fp8=true", "fast_compile=auto"], "--serving-set") == {"fast_llm_fp8": True,
                                                                                        "fast_compile": "auto"}


def test_closed_loop_simulated_actors_step_their_own_env_between_requests(tmp_path):
    """Two actor processes, each with its own point_reach env (two tasks: the instruction
    varies), against a real loopback learner serving the tiny PI0 built for that env's layout:
    every timed chunk is executed in the env (``execute`` steps, fewer only where an episode
    ended) before the next request."""
    import torch

    from envs.registry import env_spec
    from tools.bench.common import LoopbackLearner
    from tools.bench.policy import build
    from tools.bench.policy_actors import HASH, run_actors

    env = {"name": "point_reach", "image_size": 32, "num_tasks": 2, "task_id": "all", "max_episode_steps": 7}
    spec = env_spec(env)
    policy, _ = build("pi0", True, "cpu", tmp_path, spec)
    policy.eval()
    ll = LoopbackLearner(policy, spec, HASH, buffer_capacity=8, device=torch.device("cpu"),
                         service_kw={"peer_timeout_s": 120.0}, inference_kw={"max_batch": 4})
    ll.start()
    try:
        cams = {c: list(s) for c, s in spec.cameras.items()}
        r = run_actors(2, ll.port, 3.0, spec.state_dim, cams, env=env, execute=3,
                       counters=lambda: (ll.inference.batches, ll.inference.served))
    finally:
        ll.close()
    sim, chunks = r["sim"], r["chunks"]
    assert chunks > 0 and r["reply_shape"] == [1, policy.chunk_size, spec.action_dim]
    assert sim["episodes"] > 0                          # 7-step episodes: resets happened
    assert chunks * 3 - sim["episodes"] * 2 <= sim["env_steps"] <= chunks * 3
    assert sim["env_steps_per_s"] == pytest.approx(sim["env_steps"] / 3.0)
    assert 0 < sim["sim_s_per_chunk"] < 3.0


@bench
def test_train_serve_with_closed_loop_simulated_actors_on_the_cpu(tmp_path):
    out = main(["--tiny", "--device", "cpu", "--policies", "pi0", "--actors", "2", "--seconds", "2",
                "--repeats", "1", "--streams", "window", "--train-batch", "2", "--image-size", "32",
                "--period", "sim,0.5", "--env", "point_reach", "--env-set", "num_tasks=2", "--env-set", "task_id=all",
                "--json", str(tmp_path / "out.json")])
    r = out["policies"]["pi0"]
    assert out["env"]["name"] == "point_reach" and r["execute"] == 5
    assert set(r["by_period"]) == {"sim", "0.5"}
    sim = {x["phase"]: x for x in r["runs"] if x["period_s"] == "sim"}
    for kind in ("serve", "both"):
        assert sim[kind]["act"]["sim"]["env_steps"] > 0 and sim[kind]["act"]["chunks_per_s"] > 0
    assert all("sim" not in x["act"] for x in r["runs"] if x["period_s"] == 0.5 and "act" in x)
    # the sim load's fourth phase: training beside the simulators stepping alone, no serving
    assert sim["train_sims"]["sim"]["env_steps"] > 0 and sim["train_sims"]["train"]["updates"] > 0
    assert "act" not in sim["train_sims"]
    assert not any(x["phase"] == "train_sims" for x in r["runs"] if x["period_s"] == 0.5)
    s_sim, s_robot = r["by_period"]["sim"]["window"], r["by_period"]["0.5"]["window"]
    assert s_sim["sims_ratio"] == pytest.approx(s_sim["updates_per_s_train_sims"] / s_sim["updates_per_s_train"])
    assert "sims_ratio" not in s_robot
    assert 0.0 <= s_sim["window_share_both"] <= 1.0 and s_sim["forward_s_per_s_both"] > 0
    server = sim["both"]["act"]["server"]
    assert set(server["forward_p50_ms_by_batch"]) == set(server["batch_sizes"])
    assert json.loads((tmp_path / "out.json").read_text())["policies"]["pi0"]["by_period"]["sim"]["window"][
        "act_p99_ratio"] == r["by_period"]["sim"]["window"]["act_p99_ratio"]


def test_local_simulated_actors_step_their_envs_with_no_learner():
    """``port=None``: the actor processes step their own envs on random chunks and ask no one
    (train_serve's train_sims phase); with no env to step, the call is refused."""
    from tools.bench.policy_actors import run_actors

    env = {"name": "point_reach", "image_size": 32, "num_tasks": 2, "task_id": "all", "max_episode_steps": 7}
    r = run_actors(2, None, 2.0, 4, {}, env=env, execute=3)
    sim = r["sim"]
    assert r["chunks"] > 0 and "lat_p50_ms" not in r
    assert r["chunks"] * 3 - sim["episodes"] * 2 <= sim["env_steps"] <= r["chunks"] * 3
    assert sim["episodes"] > 0 and sim["env_steps_per_s"] == pytest.approx(sim["env_steps"] / 2.0)
    with pytest.raises(ValueError, match="local actors"):
        run_actors(1, None, 1.0, 4, {})
