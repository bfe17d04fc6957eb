"""tools/bench/train_serve.py: training while serving, against each alone (issue: one GPU that
serves and trains). The default suite checks the trace summary; the CPU run of the whole bench
(tiny PI0, real actor processes over loopback) is behind TANDEM_BENCH_TESTS=1 (~70 s)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tools.bench.train_serve import GilProbe, main, stream_overlap


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
    from tools.bench.train_serve import Trainer, update_for

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
