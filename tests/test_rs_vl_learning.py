"""Rejection sampling on ``env=point_reach_vl`` against its demos-only control, one registered
seed (docs/preregistered.md, claim 2), through the real learner and actor processes (CPU).

The run and the measurement are :mod:`tools.experiments.rs_vl_learning`'s: seed 0, arm ``rs`` then arm
``demos`` (``algo.demo_ratio=1.0``, the same steps on the demos alone), start and after on the
100 held-out episodes. Asserted: the seed passes by the registered rule
(:func:`tools.experiments.rs_vl_report.seed_passes`: RS after >= its start + 0.10 and >= the control's
after + 0.10), RS kept online successes, and both arms start from the same pretrained policy.
In the registered runs the claim did not hold (docs/learning.md), seed 0 included, so the test
is marked xfail (not strict): it reports XPASS once a recipe passes.
All five seeds: ``python -m tools.experiments.rs_vl_learning --out OUT`` then ``python -m
tools.experiments.rs_vl_report OUT/results.jsonl`` (docs/learning.md).
"""

from __future__ import annotations

import os

import pytest

# two learning runs of ~4 min each on 2 shared cores:
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s tests/test_rs_vl_learning.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="two ~4-minute learning runs: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s tests/test_rs_vl_learning.py")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tools.experiments.rs_vl_learning import prepare, run

    out = tmp_path_factory.mktemp("rs_vl")
    demos = prepare(out)
    return {arm: run(out, demos, seed=0, arm=arm) for arm in ("rs", "demos")}


def test_both_arms_ran_their_cycles_from_the_same_start(runs):
    rs, demos = runs["rs"], runs["demos"]
    print(f"\nrejection sampling: {rs}\ndemos-only control: {demos}")
    assert rs["cycles"] == demos["cycles"] == 5
    assert rs["kept_episodes"] > 0 and rs["success_store"] > 0
    assert rs["start"] == demos["start"]   # the same pretrained policy, the same held-out episodes


@pytest.mark.xfail(strict=False, reason="claim 2 did not hold in its registered runs (seed 0 among the "
                   "failing seeds; docs/learning.md): kept as the check a better recipe must pass")
def test_rejection_sampling_beats_its_demos_only_control(runs):
    from tools.experiments.rs_vl_report import seed_passes

    rs, demos = runs["rs"], runs["demos"]
    assert seed_passes(rs, demos), (rs, demos)
