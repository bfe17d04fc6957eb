"""Claim 7 (docs/preregistered.md), one registered seed: expert corrections through the actor's
intervention path, kept by rejection sampling (arm ``rs_expert``), against the demos-only control
on ``env=point_reach_vl``, through the real learner and actor processes (CPU).

The run and the measurement are :mod:`tools.experiments.rs_vl_learning`'s: seed 0, arm
``rs_expert`` (the env's scripted demonstrator watches the actor's first 50 episodes and drives
where the policy drifts) then arm ``demos`` (``algo.demo_ratio=1.0``: the same BC steps on the
demos alone), start and after on the 100 held-out episodes. Asserted: the corrections reached
the learner as intervened records (the episodes the expert watched, fewer than every online
episode), they were kept, and the seed passes by the registered rule
(:func:`tools.experiments.rs_vl_report.seed_passes`). All five seeds:
``python -m tools.experiments.rs_vl_learning --out OUT --arm claim7`` then
``python -m tools.experiments.rs_vl_report --arm rs_expert OUT/results.jsonl``.
"""

from __future__ import annotations

import os

import pytest

# two learning runs of ~6 min each on 2 shared cores:
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 tests/test_rs_expert_vl_claim.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="two 6-minute learning runs: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s -n 0 tests/test_rs_expert_vl_claim.py")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tools.experiments.rs_vl_learning import prepare, run

    out = tmp_path_factory.mktemp("rs_expert_vl")
    demos = prepare(out)
    return {arm: run(out, demos, seed=0, arm=arm) for arm in ("rs_expert", "demos")}


def test_the_corrections_reached_the_learner_and_were_kept(runs):
    from tools.experiments.rs_vl_learning import EXPERT_EPISODES

    ex, demos = runs["rs_expert"], runs["demos"]
    print(f"\nexpert-corrected: {ex}\ndemos-only control: {demos}")
    assert ex["cycles"] == demos["cycles"] == 5
    assert 0 < ex["intervened_episodes"] <= EXPERT_EPISODES < ex["online_episodes"]
    assert ex["intervened_steps"] >= ex["intervened_episodes"]
    assert demos["intervened_episodes"] == 0
    assert ex["kept_episodes"] >= ex["intervened_episodes"]  # HG-DAgger: corrected episodes are kept
    assert ex["start"] == demos["start"]  # the same pretrained policy, the same held-out episodes


def test_corrections_beat_the_demos_only_control(runs):
    from tools.experiments.rs_vl_report import seed_passes

    assert seed_passes(runs["rs_expert"], runs["demos"]), (runs["rs_expert"], runs["demos"])
