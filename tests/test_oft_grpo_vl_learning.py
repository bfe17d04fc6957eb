"""The pieces of claim 9's tool (tools/experiments/oft_grpo_vl_learning.py), cheap, in process: the
per-seed rule, the arguments, the learner's overrides (they compose as the learner's config: GRPO
on both tasks of ``env=point_reach_vl``, the tiny OFT's trainable set), and the premises of the
base and of the measurement on a real tiny OFT built by the tool: it reads the instruction and
sees the image (its action tokens' logits change with either alone), the base builder's SFT
weights load back as ``policy.init_trainable``, and a GRPO checkpoint's policy state (the whole
module's state dict) loads back into the policy the tool evaluates. The registered run itself is
tests/test_oft_grpo_vl_claim.py (gated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def test_seed_passes_needs_both_margins():
    from tools.experiments.oft_grpo_vl_learning import MARGIN, seed_passes

    assert MARGIN == 0.10
    assert seed_passes({"grpo_after": 0.30, "start": 0.20, "more_bc_after": 0.20})  # 0.1 after rounding
    assert seed_passes({"grpo_after": 0.45, "start": 0.10, "more_bc_after": 0.30})
    assert not seed_passes({"grpo_after": 0.45, "start": 0.10, "more_bc_after": 0.36})  # the control's margin
    assert not seed_passes({"grpo_after": 0.25, "start": 0.16, "more_bc_after": 0.05})  # the start's margin


def test_arguments_and_overrides_compose_as_the_learners_config():
    from tools.experiments.oft_grpo_vl_learning import (ACTORS, ALGO_O, BASE_STEPS, CHUNK, LORA_RANK, UPDATES,
                                                         parse_args, policy_o)
    from tools.experiments.rs_vl_learning import ENV_O
    from tools.sft import learner_config

    a = parse_args(["--out", "/tmp/x"])
    assert (a.seeds, a.updates, a.actors, a.base_steps, a.arms, a.overrides) == (
        [0, 1, 2, 3, 4], UPDATES, ACTORS, BASE_STEPS, "all", [])
    a = parse_args(["--out", "/tmp/x", "--seeds", "100", "101", "--updates", "3", "--arms", "grpo", "--",
                    "algo.lr=1e-4"])
    assert (a.seeds, a.updates, a.arms, a.overrides) == ([100, 101], 3, "grpo", ["algo.lr=1e-4"])

    cfg = learner_config([*ENV_O, *policy_o(Path("/c"), Path("/i.safetensors")), *ALGO_O, "algo.jobs_seed=3",
                          *a.overrides])  # composes: no override given twice
    assert (cfg.algo.name, list(cfg.algo.task_ids), cfg.algo.group_size, cfg.algo.batch_groups, cfg.algo.lr,
            cfg.algo.epochs, cfg.algo.loss_agg, cfg.algo.kl_coef, cfg.algo.jobs_seed) == (
        "grpo", [0, 1], 8, 4, 1e-4, 2, "episode_mean", 0.0, 3)
    p = cfg.policy
    assert (p.name, p.checkpoint, p.init_trainable, p.chunk_size, p.lora_rank, p.value_head_dim, p.device) == (
        "openvla_oft_discrete", "/c", "/i.safetensors", CHUNK, LORA_RANK, 0, "cpu")
    assert list(p.trainable_heads) == ["proprio_projector", "model.language_model.lm_head"]
    assert cfg.env.num_tasks == 2 and not cfg.env.state_has_target and not cfg.env.dense_reward
    assert "policy.init_trainable=/i.safetensors" not in policy_o(Path("/c"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tool's base on a real tiny OFT (weights from seed 0) after 3 SFT steps on 2 demos."""
    from tools.experiments.oft_grpo_vl_learning import make_base
    from tools.experiments.rs_vl_learning import prepare

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("oft_vl")
    return make_base(out, prepare(out, 2), 0, steps=3)


def obs_batch(seed: int, task: str | None = None) -> dict:
    from actor.loop import obs_arrays
    from envs.registry import make_env
    from tools.experiments.rs_vl_learning import ENV_O
    from tools.sft import learner_config

    env = make_env(learner_config(ENV_O).env)
    try:
        obs, _ = env.reset(seed=seed)
    finally:
        env.close()
    arrays, tasks = obs_arrays(obs)
    return {**{k: torch.from_numpy(v) for k, v in arrays.items()}, "task": [task] if task else tasks}


@pytest.mark.timeout(120)
def test_the_base_reads_the_instruction_and_sees_the_image(built):
    from tools.experiments.oft_grpo_vl_learning import oft

    ckpt, init = built
    policy = oft(ckpt, init)
    assert list(policy.spec.cameras) == ["image"] and policy.spec.has_task  # one camera, an instruction
    assert policy.spec.state_dim == 2  # the agent's (x, y): no target in the state
    red, green = "reach the red target", "reach the green target"
    assert policy._token_rows([red])[0].tolist() != policy._token_rows([green])[0].tolist()

    def logits(b):
        with torch.no_grad():
            return policy.action_logits(policy.action_hidden(b))

    a, b = obs_batch(1), obs_batch(2)
    b["observation.state"] = a["observation.state"].clone()  # only the image differs
    same_image_red, same_image_green = {**a, "task": [red]}, {**a, "task": [green]}
    assert not torch.allclose(logits(same_image_red), logits(same_image_green), atol=1e-5)  # the instruction
    assert not torch.allclose(logits({**a, "task": [red]}), logits({**b, "task": [red]}), atol=1e-5)  # the image


@pytest.mark.timeout(120)
def test_the_sft_weights_and_a_grpo_state_load_back(built):
    import numpy as np
    from safetensors.torch import load_file

    from tools.experiments.oft_grpo_vl_learning import oft

    ckpt, init = built
    base = oft(ckpt, init)
    saved = load_file(str(init))
    got = base.trainable_state_dict()
    assert set(saved) == set(got) and all(torch.equal(saved[k], got[k].cpu()) for k in saved)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # SFT moved the adapters
    batch = obs_batch(7)

    def act(p):
        with torch.no_grad():
            return p.act(batch, deterministic=True).extras["action_tokens"]

    learner = oft(ckpt, init).train()  # as the learner holds it: adapters live; "train" them
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    state = {k: v.clone() for k, v in learner.state_dict().items()}
    trained = act(learner.eval())
    assert not torch.equal(trained, act(base))
    np.testing.assert_array_equal(act(oft(ckpt, init, state)).numpy(), trained.numpy())
