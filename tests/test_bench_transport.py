"""Smoke run of tools/bench_transport.py with tiny iteration counts (a few seconds)."""

import json

from tools import bench_transport


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
