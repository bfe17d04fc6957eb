"""tools/bench/aot_start.py and tools/bench/trace_cost.py: what start-up spends on the host
(tracing, cache reads) against an ahead-of-time compiled function. Each runs several fresh
processes that compile with inductor on the CPU: behind TANDEM_BENCH_TESTS=1 (~3 min)."""

from __future__ import annotations

import os

import pytest

bench = pytest.mark.skipif(not os.environ.get("TANDEM_BENCH_TESTS"), reason="compiles in fresh processes (~3 min)")


@bench
def test_every_start_case_serves_the_same_layers_and_the_cache_cases_are_cheaper(tmp_path):
    from tools.bench.aot_start import CASES, main

    r = main(["--device", "cpu", "--depth", "2", "--repeats", "1", "--json", str(tmp_path / "a.json")])
    assert [x["case"] for x in r["runs"]] == [c for c, _ in CASES]
    assert all(x["max_diff"] < 1e-5 for x in r["runs"])     # loaded or compiled: the eager layers' result
    t = r["first_call_s"]
    assert t["warm"] < t["cold"] and t["aot_warm"] < t["aot_save"]


@bench
def test_trace_cost_times_both_graphs_cold_and_warm(tmp_path):
    from tools.bench.trace_cost import main

    r = main(["--depth", "2", "--vision-depth", "1", "--aot", "--json", str(tmp_path / "t.json")])
    cold, warm = r["cases"]["cold"], r["cases"]["warm"]
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0 and warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["first_b1_s"] < cold["first_b1_s"] and warm["again_b1_s"] < warm["first_b1_s"]
    saved, again = r["cases"]["aot_save"]["aot"], r["cases"]["aot_warm"]["aot"]
    assert saved["prefix"]["compiled"] == 2 and saved["vision"]["compiled"] >= 1
    assert again["prefix"] == {"loaded": 2, "compiled": 0, "failed": 0} and again["vision"]["compiled"] == 0


def test_cold_start_refuses_the_aot_cases_where_they_cannot_run():
    from tools.bench.cold_start import main

    with pytest.raises(SystemExit, match="mlp has no ahead-of-time path"):
        main(["--policy", "mlp", "--cases", "aot_cold,aot", "--tiny", "--device", "cpu"])
    with pytest.raises(SystemExit, match="aot_cold with aot"):
        main(["--policy", "openvla_oft", "--cases", "cold,aot", "--tiny", "--device", "cpu"])


@bench
def test_cold_start_s_aot_cases_save_then_load_the_oft_stack(tmp_path):
    from tools.bench.cold_start import main

    r = main(["--policy", "openvla_oft_discrete", "--tiny", "--device", "cpu", "--cases", "aot_cold,aot",
              "--max-batch", "2", "--json", str(tmp_path / "c.json")])
    first, second = r["cases"]["aot_cold"], r["cases"]["aot"]
    assert first["aot_files"] and second["aot_files"] == first["aot_files"]
    assert second["first_act_ms"] > 0 and second["to_serving_s"] > 0
