"""The pieces of claim 8's tool (tools/experiments/flow_ppo_vl_learning.py), cheap, in process: the
per-seed rule, the arguments, the learner's and actors' overrides (Flow-Noise with LoRA 8 around
claim 6's base, the run's ``policy.*`` overrides shared with the actors), and the measurement's
premises on a random tiny PI0 of claim 5's architecture: the flow-RL wrapper as initialised acts
deterministically as the plain PI0 does (``untrained_flow_rl`` is the start), and a PPO
checkpoint's policy state (the whole module's state dict) loads back into the policy the tool
evaluates. The registered run itself is tests/test_flow_ppo_vl_claim.py (gated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def test_seed_passes_needs_both_margins():
    from tools.experiments.flow_ppo_vl_learning import MARGIN, seed_passes

    assert MARGIN == 0.10
    assert seed_passes({"ppo_after": 0.30, "start": 0.20, "more_bc_after": 0.20})  # 0.1 after rounding
    assert seed_passes({"ppo_after": 0.45, "start": 0.10, "more_bc_after": 0.30})
    assert not seed_passes({"ppo_after": 0.45, "start": 0.10, "more_bc_after": 0.36})  # the control's margin
    assert not seed_passes({"ppo_after": 0.25, "start": 0.16, "more_bc_after": 0.05})  # the start's margin


def test_arguments_and_overrides():
    from tools.experiments.flow_ppo_demo import FLOW_O, PPO_O
    from tools.experiments.flow_ppo_vl_learning import ACTORS, UPDATES, flow_o, parse_args
    from tools.experiments.noise_vl_learning import BASE_STEPS

    a = parse_args(["--out", "/tmp/x"])
    assert (a.seeds, a.updates, a.actors, a.base_steps, a.arms, a.overrides) == (
        [0, 1, 2, 3, 4], UPDATES, ACTORS, BASE_STEPS, "all", [])
    a = parse_args(["--out", "/tmp/x", "--seeds", "100", "--updates", "3", "--arms", "ppo", "--",
                    "algo.lr=1e-4", "policy.noise_std_max=0.5"])
    assert (a.seeds, a.updates, a.arms, a.overrides) == ([100], 3, "ppo", ["algo.lr=1e-4", "policy.noise_std_max=0.5"])

    o = flow_o(Path("/b"), a.overrides)
    assert "policy.checkpoint=/b" in o and "policy.flow_rl=noise" in o and "policy.lora_rank=0" not in o
    assert o[-len(FLOW_O) - 1:] == [*FLOW_O, "policy.noise_std_max=0.5"]  # the run's policy.* last: they win
    assert "algo.lr=1e-4" not in o and PPO_O[0] == "algo=ppo"

    from tools.experiments.rs_vl_learning import ENV_O
    from tools.sft import learner_config

    cfg = learner_config([*ENV_O, *flow_o(Path("/b")), *PPO_O])  # composes: no override given twice
    assert (cfg.algo.name, cfg.policy.flow_rl, cfg.policy.lora_rank, cfg.policy.init_noise_scale) == ("ppo", "noise",
                                                                                                       8, 0)
    assert cfg.env.num_tasks == 2 and not cfg.env.state_has_target and not cfg.env.dense_reward


@pytest.mark.timeout(120)
def test_untrained_flow_rl_acts_as_the_base_and_a_ppo_state_loads(tmp_path):
    import numpy as np

    from actor.loop import obs_arrays
    from envs.registry import env_spec, make_env
    from tools.experiments.flow_ppo_vl_learning import ppo_policy
    from tools.experiments.noise_vl_learning import ARCH, CHUNK, pi0
    from tools.experiments.rs_vl_learning import ENV_O
    from tools.make_tiny_checkpoints import make_pi0
    from tools.sft import learner_config

    env_cfg = learner_config(ENV_O).env
    base = make_pi0(tmp_path / "base", env_spec(env_cfg), arch=ARCH, chunk_size=CHUNK, image_size=32, seed=0)
    env = make_env(env_cfg)
    try:
        obs, _ = env.reset(seed=7)
    finally:
        env.close()
    arrays, tasks = obs_arrays(obs)
    batch = {**{k: torch.from_numpy(v) for k, v in arrays.items()}, "task": tasks}

    def act(p):
        with torch.no_grad():
            return p.act(batch, deterministic=True).actions

    plain, flow = pi0(base), ppo_policy(base, seed=0)
    assert torch.allclose(act(plain), act(flow), atol=1e-5)  # LoRA B = 0, no noise head at deployment

    flow.train()  # as the learner holds it: adapters live; "train" some adapters and the noise head
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in flow.named_parameters():
            if "lora_B" in name or name.startswith("heads.noise"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    state = {k: v.clone() for k, v in flow.state_dict().items()}
    trained = act(flow.eval())
    assert not torch.allclose(trained, act(plain), atol=1e-3)

    back = ppo_policy(base, seed=0, state=state)
    np.testing.assert_allclose(act(back).numpy(), trained.numpy(), atol=1e-5)
    assert torch.equal(back.trainable_state_dict()["flow_rl.noise.0.weight"], state["heads.noise.0.weight"])
