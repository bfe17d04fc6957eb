"""Rejection sampling on ``env=point_reach_vl`` against its demos-only control, one registered
seed (docs/preregistered.md, claim 2 with the MLP, claim 5 with the tiny PI0 built from
scratch), through the real learner and actor processes (CPU).

The run and the measurement are :mod:`tools.experiments.rs_vl_learning`'s: seed 0, arm ``rs`` then arm
``demos`` (``algo.demo_ratio=1.0``, the same steps on the demos alone), start and after on the
100 held-out episodes. Asserted: the seed passes by the registered rule
(:func:`tools.experiments.rs_vl_report.seed_passes`: RS after >= its start + 0.10 and >= the control's
after + 0.10), RS kept online successes, and both arms start from the same pretrained policy.
Where a claim did not hold in its registered runs (docs/learning.md), the policy's case is
marked xfail (not strict): it reports XPASS once a recipe passes.
All five seeds: ``python -m tools.experiments.rs_vl_learning --out OUT [--policy pi0]`` then
``python -m tools.experiments.rs_vl_report OUT/results.jsonl`` (docs/learning.md).
"""

from __future__ import annotations

import os

import pytest

# per policy, two learning runs of ~4 (MLP) or ~7 (PI0) min each on 2 shared cores:
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 tests/test_rs_vl_learning.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="four 4-7-minute learning runs: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s -n 0 tests/test_rs_vl_learning.py")]

#: the policies whose claim did not hold in its registered runs (docs/preregistered.md, Outcomes)
NOT_HOLDING = {"mlp": "claim 2", "pi0": "claim 5"}


@pytest.fixture(scope="module", params=["mlp", "pi0"])
def runs(request, tmp_path_factory):
    from tools.experiments.rs_vl_learning import prepare, run

    out = tmp_path_factory.mktemp(f"rs_vl_{request.param}")
    demos = prepare(out)
    return {arm: run(out, demos, seed=0, arm=arm, policy=request.param) for arm in ("rs", "demos")}


def test_both_arms_ran_their_cycles_from_the_same_start(runs):
    rs, demos = runs["rs"], runs["demos"]
    print(f"\nrejection sampling: {rs}\ndemos-only control: {demos}")
    assert rs["cycles"] == demos["cycles"] == 5
    assert rs["kept_episodes"] > 0 and rs["success_store"] > 0
    if rs["policy"] == "mlp":   # the same pretrained policy, the same held-out episodes
        assert rs["start"] == demos["start"]
    # the PI0's pretraining differs between the arms: its acts, served on the learner's
    # inference thread while it pretrains, draw from the torch generator its training draws from


def test_rejection_sampling_beats_its_demos_only_control(runs, request):
    from tools.experiments.rs_vl_report import seed_passes

    rs, demos = runs["rs"], runs["demos"]
    if rs["policy"] in NOT_HOLDING:
        request.applymarker(pytest.mark.xfail(strict=False, reason=f"{NOT_HOLDING[rs['policy']]} did not hold in "
                                              "its registered runs (docs/learning.md): kept as the check a better "
                                              "recipe must pass"))
    assert seed_passes(rs, demos), (rs, demos)
