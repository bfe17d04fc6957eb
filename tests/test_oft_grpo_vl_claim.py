"""GRPO on a tiny OpenVLA-OFT (discrete action tokens) on ``env=point_reach_vl`` against its
controls, one registered seed (docs/preregistered.md, claim 9), through the real learner and two
actor processes (CPU). The cheap pieces of the same tool are tests/test_oft_grpo_vl_learning.py
(default suite).

The run and the measurement are :mod:`tools.experiments.oft_grpo_vl_learning`'s: seed 0's weak
tiny OFT (built from scratch, SFT on the 10 scripted demos: image + instruction, the state has no
target), ``algo=grpo policy=openvla_oft_discrete`` for the registered number of updates on the 0/1
success, then the more-BC control for the same wall-clock, every arm on the 100 held-out episodes,
deterministic (greedy tokens). Asserted: the learner updated, the control trained, and the seed
passes by the registered rule (:func:`tools.experiments.oft_grpo_vl_learning.seed_passes`: GRPO's
after >= start + 0.10 and >= more-BC after + 0.10). Where the claim did not hold in its registered
runs, the rule's assertion is marked xfail (not strict). All five seeds: ``python -m
tools.experiments.oft_grpo_vl_learning --out OUT --seeds 0 1 2 3 4`` (docs/learning.md).
"""

from __future__ import annotations

import os

import pytest

# one seed: a GRPO run and its more-BC control of the same wall-clock, ~10-15 min on 2 cores:
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 tests/test_oft_grpo_vl_claim.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="a 10-15-minute learning run: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s -n 0 tests/test_oft_grpo_vl_claim.py")]

#: set when claim 9 did not hold in its registered runs (docs/preregistered.md, Outcomes)
NOT_HOLDING: str | None = ("claim 9 does not hold: 0/5 registered seeds pass (seed 0: start 0.20, GRPO after 0.18, "
                             "more-BC 0.13; docs/preregistered.md, Outcomes)")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    import torch

    from tools.experiments.oft_grpo_vl_learning import DEMOS, run_seed
    from tools.experiments.rs_vl_learning import prepare

    torch.set_num_threads(1)  # as the tool's main runs the evaluations
    out = tmp_path_factory.mktemp("oft_grpo_vl")
    return run_seed(out, prepare(out, DEMOS), 0)


def test_oft_grpo_trained(result):
    print(f"\nOFT GRPO, seed 0: {({k: v for k, v in result.items() if k != 'trace'})}")
    from tools.experiments.oft_grpo_vl_learning import UPDATES

    assert result["updates"] >= UPDATES and result["more_bc_steps"] > 0


def test_oft_grpo_beats_its_controls(result, request):
    from tools.experiments.oft_grpo_vl_learning import seed_passes

    if NOT_HOLDING:
        request.applymarker(pytest.mark.xfail(strict=False, reason=NOT_HOLDING))
    assert seed_passes(result), result
