"""Flow-Noise PPO on ``env=point_reach_vl`` against its controls, one registered seed
(docs/preregistered.md, claim 8), through the real learner and two actor processes (CPU). The
cheap pieces of the same tool are tests/test_flow_ppo_vl_learning.py (default suite).

The run and the measurement are :mod:`tools.experiments.flow_ppo_vl_learning`'s: seed 0's weak
tiny PI0 (claim 6's base: image + instruction, the state has no target), ``algo=ppo policy=pi0
policy.flow_rl=noise`` for the registered number of updates on the 0/1 success, then the more-BC
control for the same wall-clock, every arm on the 100 held-out episodes, deterministic. Asserted:
the learner updated, the untrained flow-RL wrapper measures as the start, and the seed passes by
the registered rule (:func:`tools.experiments.flow_ppo_vl_learning.seed_passes`: PPO's after >=
start + 0.10 and >= more-BC after + 0.10). Where the claim did not hold in its registered runs,
the rule's assertion is marked xfail (not strict). All five seeds: ``python -m
tools.experiments.flow_ppo_vl_learning --out OUT --seeds 0 1 2 3 4`` (docs/learning.md).
"""

from __future__ import annotations

import os

import pytest

# one seed: a PPO run and its more-BC control of the same wall-clock, ~8-15 min on 2 cores
# (the registered seeds took 477-572 s each at load ~1-2.5; a pilot 871 s at load 5-7):
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 tests/test_flow_ppo_vl_claim.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="an 8-15-minute learning run: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s -n 0 tests/test_flow_ppo_vl_claim.py")]

#: set when claim 8 did not hold in its registered runs (docs/preregistered.md, Outcomes)
NOT_HOLDING: str | None = ("claim 8 did not hold in its registered runs (0/5 seeds; seed 0: "
                           "0.19 -> 0.19 against more-BC 0.27, docs/learning.md): kept as the check a better recipe "
                           "must pass")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tools.experiments.flow_ppo_vl_learning import DEMOS, run_seed
    from tools.experiments.rs_vl_learning import prepare

    import torch

    torch.set_num_threads(1)  # as the tool's main runs the evaluations
    out = tmp_path_factory.mktemp("flow_ppo_vl")
    return run_seed(out, prepare(out, DEMOS), 0)


def test_flow_ppo_trained(result):
    print(f"\nFlow-Noise PPO, seed 0: {({k: v for k, v in result.items() if k != 'trace'})}")
    from tools.experiments.flow_ppo_vl_learning import UPDATES

    assert result["updates"] >= UPDATES and result["more_bc_steps"] > 0
    assert result["untrained_flow_rl"] == result["start"]


def test_flow_ppo_beats_its_controls(result, request):
    from tools.experiments.flow_ppo_vl_learning import seed_passes

    if NOT_HOLDING:
        request.applymarker(pytest.mark.xfail(strict=False, reason=NOT_HOLDING))
    assert seed_passes(result), result
