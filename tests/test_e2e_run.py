"""tools/bench/e2e_run.py measures a real learner + actors from outside (CPU smoke run: GRPO jobs,
MLP policy, point_reach)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_e2e_run_reports_throughput_updates_and_version_lag(tmp_path):
    from tools.bench.e2e_run import main

    out = tmp_path / "e2e"
    res = main(["--out", str(out), "--actors", "2", "--minutes", "0.2", "--sample-s", "1",
                "--common", "env=point_reach", "policy=mlp",
                "--learner", "algo=grpo", "algo.group_size=4", "algo.batch_groups=2",
                "algo.dynamic_sampling=false", "device=cpu", "trainer.num_threads=1",
                "buffer.persist=false"])
    assert json.loads((out / "e2e.json").read_text())["final"] is True
    assert res["steady_s"] > 6 and res["env_steps_per_s"] > 10 and res["episodes_per_s"] > 0
    assert res["chunks_served_per_s"] > 0 and res["mean_served_batch"] >= 1.0
    assert res["update_s"]["all"] and res["version_lag"]["max"] >= 0  # rounds trained and logged
    assert res["version"] >= 1  # the learner published what it trained
    assert {a["actor"] for a in res["actors"]} == {"a00", "a01"}
