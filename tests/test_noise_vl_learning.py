"""Noise-space SAC (DSRL) on ``env=point_reach_vl`` against its controls, one registered seed
(docs/preregistered.md, claim 6), through the real learner and actor processes (CPU).

The run and the measurement are :mod:`tools.experiments.noise_vl_learning`'s: seed 0's weak tiny
PI0 (image + instruction; the state has no target), ``algo=sac_noise policy=pi0`` with two
remote actors for the registered number of updates, then the more-BC control for the same
wall-clock and the untrained noise actor, every arm on the 100 held-out episodes. Asserted: the
learner updated, and the seed passes by the registered rule
(:func:`tools.experiments.noise_vl_learning.seed_passes`: the noise actor's after >= start + 0.10,
>= more-BC after + 0.10 and >= the untrained noise actor + 0.10). Where the claim did not hold
in its registered runs (docs/learning.md), the rule's assertion is marked xfail (not strict):
it reports XPASS once a recipe passes. All five seeds: ``python -m
tools.experiments.noise_vl_learning --out OUT`` (docs/learning.md).
"""

from __future__ import annotations

import os

import pytest

# one seed: a noise-SAC run and its more-BC control of the same wall-clock, ~7-8 min on 2 cores
# (the registered seeds took 388-468 s each):
# TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 tests/test_noise_vl_learning.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="a 7-8-minute learning run: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q -s -n 0 tests/test_noise_vl_learning.py")]

#: set when claim 6 did not hold in its registered runs (docs/preregistered.md, Outcomes)
NOT_HOLDING: str | None = ("claim 6 did not hold in its registered runs (1/5 seeds; seed 0: 0.06 -> 0.13 against "
                           "more-BC 0.21, docs/learning.md): kept as the check a better recipe must pass")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tools.experiments.noise_vl_learning import DEMOS, run_seed
    from tools.experiments.rs_vl_learning import prepare

    import torch

    torch.set_num_threads(1)  # as the tool's main runs the evaluations
    out = tmp_path_factory.mktemp("noise_vl")
    return run_seed(out, prepare(out, DEMOS), 0)


def test_the_noise_actor_trained(result):
    print(f"\nnoise-space SAC, seed 0: {({k: v for k, v in result.items() if k != 'trace'})}")
    from tools.experiments.noise_vl_learning import UPDATES

    assert result["updates"] >= UPDATES and result["more_bc_steps"] > 0


def test_noise_sac_beats_its_controls(result, request):
    from tools.experiments.noise_vl_learning import seed_passes

    if NOT_HOLDING:
        request.applymarker(pytest.mark.xfail(strict=False, reason=NOT_HOLDING))
    assert seed_passes(result), result
