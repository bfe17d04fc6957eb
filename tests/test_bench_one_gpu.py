"""tools/bench/one_gpu.py: the one-GPU issue's figures in one run. The whole CPU run (tiny PI0,
real actor processes over loopback, three fresh start-up processes) is behind
TANDEM_BENCH_TESTS=1 (~50 s)."""

from __future__ import annotations

import json
import os

import pytest

from tools.bench.one_gpu import main


def test_an_unknown_stage_is_named_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="unknown stage 'serve'"):
        main(["--stages", "policy,serve", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not os.environ.get("TANDEM_BENCH_TESTS"), reason="set TANDEM_BENCH_TESTS=1 (~50 s)")
def test_one_cpu_run_reports_every_figure_beside_its_target(tmp_path):
    out = tmp_path / "one.json"
    r = main(["--tiny", "--device", "cpu", "--policies", "pi0", "--peak-actors", "2", "--seconds", "2",
              "--repeats", "1", "--streams", "window", "--period", "0", "--iters", "5", "--json", str(out)])
    assert r["failed"] == {} and set(r["stage_s"]) == {"policy", "train_serve", "cold_start"}
    assert json.loads(out.read_text())["summary"] == r["summary"]
    s = r["summary"]
    act = r["policy"]["policies"]["pi0"]["act_ms"]
    assert s["batch1_act_ms"]["pi0"]["p50"] == act["p50"] and s["batch1_act_ms"]["pi0"]["target"] == 12.0
    assert s["batch1_act_ms"]["pi0"]["met"] == (act["p50"] <= 12.0)
    two = [a for a in r["policy"]["policies"]["pi0"]["actors"] if a["actors"] == 2][0]
    assert s["share_of_peak"]["pi0"]["actors"] == 2 and s["share_of_peak"]["pi0"]["mfu"] == two["mfu"] > 0
    assert r["train_serve"]["batch_due_ms"] == 400.0  # one_gpu's default: simulated actors served in step
    m = r["train_serve"]["policies"]["pi0"]["by_period"]["0"]["window"]
    ts = s["train_serve"]["pi0"]["period 0 s"]["window"]
    assert ts["update_ratio"] == min(m["update_ratio"], m["step_ratio"])
    assert ts["act_p99_ratio"] == m["act_p99_ratio"] and ts["met"] == m["meets_targets"]
    assert ts["window_share_both"] == m["window_share_both"] and "sims_ratio" not in ts  # (no simulators)
    start = s["start_s"]["pi0"]
    assert set(start["to_serving_s"]) == {"cold", "artefacts", "warm"}
    assert all(0 < t < 120 for t in start["to_serving_s"].values())
    assert start["met"] == (start["to_serving_s"]["artefacts"] <= 30.0)
