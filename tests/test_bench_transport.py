"""Smoke run of tools/bench/transport.py with tiny iteration counts (a few seconds)."""

import json

from tools.bench import transport as bench_transport


def test_bench_transport_json_smoke(capsys):
    rc = bench_transport.main([
        "--json", "--act-iters", "20", "--act-warmup", "5", "--act-rounds", "2",
        "--ingest-batches", "2", "--ingest-rounds", "2", "--ingest-warmup-batches", "1",
        "--batch-records", "4", "--ingest-image", "32", "--act-image", "64", "--buffer-capacity", "64",
    ])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1, lines  # exactly one JSON object on stdout
    out = json.loads(lines[0])
    for key in ("act_overhead_ratio", "ingest_ratio", "act_raw_p50_us", "act_raw_p99_us",
                "act_tandem_p50_us", "act_tandem_p99_us", "ingest_raw_mb_s", "ingest_tandem_mb_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    # every transition sent through Tandem was validated and stored, none rejected
    assert out["rejected"] == 0
    assert out["records_stored"] == 4 * (1 + 2 * 2)
    assert len(out["act_rounds"]["raw"]) == len(out["act_rounds"]["tandem"]) == 2


def test_bench_transport_quick_has_ratios_and_intervals(capsys):
    """--quick: both ratios with their 95% intervals, and the p50s' intervals (no speed asserts)."""
    assert bench_transport.main(["--quick", "--json"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    out = json.loads(lines[0])
    for ratio in ("act_overhead_ratio", "ingest_ratio"):
        lo, hi = out[ratio + "_ci95"]
        assert 0 < lo <= hi and isinstance(out[ratio], float), ratio
    for key in ("act_raw_p50_ci", "act_tandem_p50_ci", "ingest_raw_mb_s_ci", "ingest_tandem_mb_s_ci"):
        ci = out[key]
        assert ci["ci95"][0] <= ci["ci95"][1] and ci["ci_rel"] >= 0 and isinstance(ci["stable"], bool), key
    p50 = out["act_tandem_p50_us"]  # the pooled interval brackets the pooled median's neighbourhood
    assert out["act_tandem_p50_ci"]["ci95"][0] <= p50 * 1.5
    assert isinstance(out["warnings"], list)
    assert out["rejected"] == 0 and out["config"]["quick"] is True
