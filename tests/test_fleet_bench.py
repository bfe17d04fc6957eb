"""Smoke run of the fleet bench (tools/bench/fleet.py): a real ``python -m learner`` on
loopback and 4 simulated robots (the product's ActorLoop / LearnerClient / Spool) in 2
processes for a few seconds; the JSON has its figures and every record was acknowledged.

Buffer persistence is off here (the LeRobot store's start-up would double the test's time);
the bench itself runs with it on. About 25-40 s on the 2-core VM, most of it the learner's
start."""

from __future__ import annotations

import json

import pytest

from tools.bench import fleet

pytestmark = pytest.mark.timeout(240)


def test_fleet_bench_smoke(tmp_path):
    out_json, out_png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    fleet.main(["--loads", "state", "--actors", "4", "--seconds", "4", "--warmup-s", "1",
                "--drain-s", "15", "--processes", "2", "--episode-steps", "10",
                "--work", str(tmp_path / "work"), "--spool-dir", str(tmp_path / "spools"),
                "--learner-override", "buffer.persist=false",
                "--json", str(out_json), "--png", str(out_png)])
    out = json.loads(out_json.read_text())
    assert out_png.stat().st_size > 0
    for key in ("command", "date", "hardware", "settings", "points", "saturation"):
        assert key in out, key
    (p,) = out["points"]
    assert p["load"] == "state" and p["actors"] == 4 and p["processes"] == 2
    assert p["errors"] == [] and p["act_failures"] == 0 and p["learner_exit"] == 0
    # every act was answered and timed; the learner batched and stored what the robots sent
    assert p["act_ms"]["n"] > 0 and 0 < p["act_ms"]["p50"] <= p["act_ms"]["p99"]
    assert p["infer_batch"] >= 1.0 and p["ingest"]["records_per_s"] > 0
    # every record the robots sent was acknowledged by the learner, none rejected
    assert p["acks"]["records"] > 0 and p["acks"]["all_acked"], p["acks"]
    assert p["acks"]["acked"] == p["acks"]["records"]
    assert p["learner"]["rejected"] == 0 and p["learner"]["internal_errors"] == 0
    # per-thread CPU of the learner, named by its status.json
    threads = p["cpu_cores"]["learner_threads"]
    assert "tandem-service" in threads and "tandem-inference" in threads, threads
    assert "wire-gate" in p["cpu_cores"]["learner_children"]
    assert p["peak_rss_mb"]["learner"] > 0 and len(p["load_avg_before"]) == 3
    assert out["saturation"]["state"]["kept_rate_up_to"] in (4, None)
