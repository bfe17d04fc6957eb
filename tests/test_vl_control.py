"""The pre-registered control of ``env=point_reach_vl`` (docs/preregistered.md, claim 1): on the
same 100 scripted demos and 1,000 BC steps, a policy that sees the state alone succeeds on
the held-out episodes at most as often as chance allows (<= 0.25), one that also sees the
image and reads the instruction at least 0.5 and at least 0.3 more often. One seed (0);
``python -m tools.experiments.vl_control`` runs more."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

STATE_MAX = 0.25
VL_MIN = 0.5
GAP = 0.3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tools.experiments.vl_control import bc_held_out, torch_threads

    torch_threads(1)
    out = tmp_path_factory.mktemp("vl_control")
    return {kind: bc_held_out(out, kind, seed=0) for kind in ("state", "vl")}


def test_state_alone_stays_at_chance_and_image_plus_instruction_does_not(results):
    state, vl = results["state"], results["vl"]
    print(f"\nstate-only BC: {state}\nimage + instruction BC: {vl}")
    assert state["transitions"] == vl["transitions"] > 1000   # the same demos
    assert state["loss_last"] < state["loss_first"] and vl["loss_last"] < vl["loss_first"]
    assert state["held_out_episodes"] == vl["held_out_episodes"] == 100
    assert state["held_out_success"] <= STATE_MAX, state
    assert vl["held_out_success"] >= VL_MIN, vl
    assert vl["held_out_success"] >= state["held_out_success"] + GAP, (state, vl)
