"""The plumbing of claim 4's tool (tools/experiments/grpo_vl_learning.py), cheap: the weak
base fitted on scripted demos, a GRPO run of 1 update from it through a real learner and two
real actor processes on loopback (``algo=grpo policy=mlp env=point_reach_vl``, groups of the
same task and start state), its final checkpoint loaded back into the MLP, and the more-BC
control for 2 s. Nothing about learning is asserted (claim 4 is a pre-registered run,
docs/preregistered.md); the held-out measurement is :func:`tools.experiments.learning_run.
evaluate_policy`, which the other tools' runs exercise."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_grpo_arm_runs_from_the_base_and_its_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file

    from tools.experiments.grpo_vl_learning import ALGO_O, train_grpo
    from tools.experiments.learning_run import timed_control
    from tools.experiments.residual_vl_learning import make_base, mlp, more_bc
    from tools.experiments.rs_vl_learning import prepare

    demos = prepare(tmp_path, demos=2)
    base = make_base(tmp_path, demos, seed=0)
    r = train_grpo(tmp_path, base, seed=0, updates=1, actors=2, max_s=150)

    assert r["status"]["updates"] >= 1 and r["checkpoint"].startswith("step_")
    rounds = [m for m in map(json.loads, open(tmp_path / "grpo_seed0" / "metrics.jsonl"))
              if "round_groups" in m]
    o = dict(x.split("=", 1) for x in ALGO_O)
    size, groups = int(o["algo.group_size"]), int(o["algo.batch_groups"])
    assert rounds and all(m["round_groups"] == groups and m["round_episodes"] == size * groups for m in rounds)
    start = load_file(str(base))
    trained = mlp(r["policy"]).trainable_state_dict()
    assert set(trained) == set(start)
    assert any(not torch.equal(trained[k], start[k]) for k in start), "GRPO's updates left the base's weights"

    # the control as the claim tools run it (learning_run.timed_control): 2 s of more BC, scored
    kept = []
    control = timed_control(lambda: more_bc(demos, base, seed=0, seconds=2.0), lambda w: kept.append(w) or 0.5)
    weights, steps = kept[0], control["more_bc_steps"]
    assert steps > 0 and set(weights) == set(start)
    assert control["more_bc_after"] == 0.5 and len(control["more_bc_load_1min"]) == 2
