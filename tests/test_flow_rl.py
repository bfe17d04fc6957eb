"""PI0 / PI0.5 with Flow-Noise and Flow-SDE (agents/policies/pi0/flow_rl.py) on tiny checkpoints:
the act's log-prob and the update's recomputation agree, the deterministic act is plain PI0's
ODE, the reference is the adapters-disabled model, bad configs fail at start-up, and a PPO
update through PPOAgent moves the chain log-probs the way the advantages say."""

import pytest
import torch

from agents import registry
from agents.base import (BCPolicy, LogProbPolicy, ReferencePolicy, ValuePolicy, capabilities_of)
from agents.policies.pi0.flow_rl import Pi0FlowRLPolicy, Pi05FlowRLPolicy
from agents.policies.pi0.policy import Pi0Policy
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
CHUNK, STEPS = 4, 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow_rl")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def build(ckpt, variant="pi0", mode="noise", **kw):
    cfg = {"name": variant, "checkpoint": str(ckpt), "chunk_size": CHUNK, "lora_rank": 4,
           "num_inference_steps": STEPS, "flow_rl": mode, "device": "cpu", **kw}
    return registry.build_policy(cfg, SPEC)


def obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"observation.state": torch.randn(b, 4, generator=g),
            "task": ["reach the red target", "reach the blue target", "x"][:b],
            "observation.images.image": torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g)}


def with_extras(o, chunk):
    return dict(o, **{f"extra.{k}": v for k, v in chunk.extras.items()})


def perturb(p, seed=1, scale=0.05):
    """Move every trainable tensor (LoRA B included, so adapters matter) off its start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in p.parameters():
            if q.requires_grad:
                q.add_(torch.randn(q.shape, generator=g) * scale)


@pytest.mark.parametrize("variant,mode", [("pi0", "noise"), ("pi0", "sde"), ("pi05", "noise"), ("pi05", "sde")])
def test_act_log_prob_matches_the_update_recomputation(ckpts, variant, mode):
    p = build(ckpts[variant], variant, mode)
    assert isinstance(p, Pi05FlowRLPolicy if variant == "pi05" else Pi0FlowRLPolicy)
    perturb(p)
    p.eval()
    torch.manual_seed(0)
    c = p.act(obs())
    spec = p.extras_spec()
    for name, (dt, shape) in spec.items():
        v = c.log_prob if name == "log_prob" else c.extras[name]
        assert tuple(v.shape) == (3, *shape), name
    assert c.actions.shape == (3, CHUNK, 2) and c.actions.abs().max() <= 1
    chain = c.extras["chain"]
    assert torch.equal(chain[:, 0], c.extras["noise"])
    assert p.extras_ranges() == ({"sde_step": (0, STEPS - 1)} if mode == "sde" else {})
    if mode == "sde":  # one stochastic step per chunk: every other step is the ODE's
        assert set(spec) == {"noise", "chain", "log_prob", "sde_step"}
        assert ((c.extras["sde_step"] >= 0) & (c.extras["sde_step"] < STEPS)).all()
    batch = with_extras(obs(), c)
    # eval mode without gradients: the same folded weights, the same ops -> equal
    with torch.no_grad():
        torch.testing.assert_close(p.log_prob(batch, c.actions), c.log_prob, rtol=0, atol=1e-5)
    # training mode with gradients (adapters unfolded: W0 x + B A x instead of (W0 + BA) x):
    # float32 rounding of ~1e-6 relative in each velocity, divided by stds >= 0.04 and summed
    # over <= STEPS * CHUNK * 2 = 32 terms, stays far below 1e-2 (a ratio of 1.01, against
    # PPO's clip range of 0.2)
    p.train()
    lp = p.log_prob(batch, c.actions)
    assert lp.requires_grad
    torch.testing.assert_close(lp.detach(), c.log_prob, rtol=0, atol=1e-2)
    tok = p.token_log_prob(batch, c.actions)  # the factors of the chain's density
    assert tok.shape == (3, STEPS * CHUNK if mode == "noise" else CHUNK)
    torch.testing.assert_close(tok.sum(-1), lp, rtol=0, atol=1e-5)
    lp.sum().backward()
    lora_grads = [q.grad for n, q in p.named_parameters() if ".lora_B" in n and "gemma_expert" in n]
    assert lora_grads and any(g is not None and g.abs().sum() > 0 for g in lora_grads)
    if mode == "noise":
        assert p.heads.noise[0].weight.grad.abs().sum() > 0
    # another chunk's chain gets another log-prob (the recomputation reads the stored path)
    other = p.act(obs())
    with torch.no_grad():
        assert not torch.allclose(p.log_prob(batch, c.actions), p.log_prob(with_extras(obs(), other), c.actions))


def test_deterministic_act_is_plain_pi0(ckpts):
    p = build(ckpts["pi0"], mode="noise").eval()
    ref = registry.build_policy({"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK,
                                 "lora_rank": 4, "num_inference_steps": STEPS, "device": "cpu"}, SPEC).eval()
    assert type(ref) is Pi0Policy
    d = p.act(obs(), deterministic=True)
    torch.testing.assert_close(d.actions, ref.act(obs(), deterministic=True).actions, rtol=0, atol=1e-5)
    torch.testing.assert_close(d.actions, p.act(obs(), deterministic=True).actions, rtol=0, atol=0)
    with torch.no_grad():  # its log-prob is the same function of its chain
        torch.testing.assert_close(p.log_prob(with_extras(obs(), d), d.actions), d.log_prob, rtol=0, atol=1e-5)
    # sampled chunks differ from it, and from each other
    s1, s2 = p.act(obs()), p.act(obs())
    assert not torch.allclose(s1.actions, d.actions) and not torch.allclose(s1.actions, s2.actions)


def test_capabilities_pairs_and_bad_configs(ckpts):
    caps = capabilities_of(Pi0FlowRLPolicy)
    assert {BCPolicy, LogProbPolicy, ValuePolicy, ReferencePolicy} <= caps
    registry.check_algo_policy({"name": "ppo", "kl_kind": "k3", "kl_coef": 0.1},
                               {"name": "pi0", "flow_rl": "noise"})
    registry.check_algo_policy("ppo", {"name": "pi05", "flow_rl": "sde"})
    with pytest.raises(ValueError, match="'ppo' cannot train policy 'pi0'.*LogProbPolicy"):
        registry.check_algo_policy("ppo", {"name": "pi0", "flow_rl": None})
    with pytest.raises(ValueError, match="flow_rl must be null.*'bogus'"):
        registry.check_algo_policy("ppo", {"name": "pi0", "flow_rl": "bogus"})
    with pytest.raises(ValueError, match="flow_rl must be null.*'bogus'"):
        build(ckpts["pi0"], mode="bogus")
    with pytest.raises(ValueError, match="noise_std_min < noise_std_max"):
        build(ckpts["pi0"], noise_std_min=0.5, noise_std_max=0.1)
    with pytest.raises(ValueError, match="value_features"):
        build(ckpts["pi0"], value_features="vision")
    p = build(ckpts["pi0"])
    with pytest.raises(ValueError, match="extra.chain"):
        p.log_prob(obs(), torch.zeros(3, CHUNK, 2))
    bad = dict(obs(), **{"extra.chain": torch.zeros(3, STEPS, CHUNK, 32)})
    with pytest.raises(ValueError, match=r"extra.chain must be \[3, 5, 4, 32\]"):
        p.log_prob(bad, torch.zeros(3, CHUNK, 2))


def test_reference_is_the_model_without_adapters_and_sync_carries_the_noise_head(ckpts):
    p = build(ckpts["pi0"]).eval()
    torch.manual_seed(0)
    c = p.act(obs())
    batch = with_extras(obs(), c)
    with torch.no_grad():
        start = p.log_prob(batch, c.actions)
        perturb(p)
        moved = p.log_prob(batch, c.actions)
        with p.reference():
            ref = p.log_prob(batch, c.actions)
        after = p.log_prob(batch, c.actions)
    assert (moved - start).abs().max() > 1e-2
    torch.testing.assert_close(ref, start, rtol=0, atol=1e-4)  # LoRA B started at 0: adapters off = start
    torch.testing.assert_close(after, moved, rtol=0, atol=1e-6)
    # the weights sync: adapters, heads and the noise head; a second copy then acts the same
    state = p.trainable_state_dict()
    assert any(k.startswith("flow_rl.noise.") for k in state) and not any("heads.value" in k for k in state)
    q = build(ckpts["pi0"]).eval()
    q.load_trainable_state_dict(state)
    torch.manual_seed(3)
    a = p.act(obs())
    torch.manual_seed(3)
    b = q.act(obs())
    torch.testing.assert_close(a.log_prob, b.log_prob, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="noise head"):
        build(ckpts["pi0"], mode="sde").load_trainable_state_dict(state)


def test_ppo_update_moves_chain_log_probs_with_the_advantages(ckpts):
    from accelerate import Accelerator

    from agents.ppo.agent import PPOAgent, PPOConfig

    p = build(ckpts["pi0"], value_features="prefix").eval()
    torch.manual_seed(0)
    o = obs(4, seed=2)
    o["task"] = ["reach the red target"] * 4
    c = p.act(o)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    batch = dict(with_extras(o, c), action=c.actions, old_log_prob=c.log_prob, advantages=adv,
                 returns=adv.clone())
    agent = PPOAgent(PPOConfig(epochs=4, minibatch_size=4, lr=1e-3, is_truncation=2.0, value_clip=None),
                     p, p, Accelerator(cpu=True))
    v0 = p.value(o).detach()
    m = agent.update(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert abs(m["is_weight_mean"] - 1.0) < 1e-2  # on-policy: behaviour == recomputed
    p.eval()
    with torch.no_grad():
        delta = p.log_prob(batch, c.actions) - c.log_prob
    assert (delta[adv > 0] > 0).all() and (delta[adv < 0] < 0).all(), delta
    # the value head moved toward the returns
    v1 = p.value(o).detach()
    assert ((v1 - adv).abs().mean() < (v0 - adv).abs().mean()), (v0, v1)


def test_chunks_cut_short_train_the_value_head_too(ckpts):
    """``chunk.execute`` below the chunk size makes every chunk partial (``mask`` all False) but
    the policy's own: the value head must still regress to the returns on them (its loss and
    the explained variance over those chunks), not only the policy loss."""
    from accelerate import Accelerator

    from agents.ppo.agent import PPOAgent, PPOConfig

    p = build(ckpts["pi0"], value_features="prefix").eval()
    torch.manual_seed(0)
    o = obs(4, seed=3)
    o["task"] = ["reach the red target", "reach the blue target"] * 2
    c = p.act(o)
    ret = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch = dict(with_extras(o, c), action=c.actions, old_log_prob=c.log_prob, advantages=ret - 0.5,
                 returns=ret.clone(), mask=torch.zeros(4, dtype=torch.bool),
                 own_chunk=torch.ones(4, dtype=torch.bool), chunk_steps=torch.full((4,), 2, dtype=torch.long))
    agent = PPOAgent(PPOConfig(epochs=4, minibatch_size=4, lr=1e-3, value_clip=None), p, p, Accelerator(cpu=True))
    assert agent.has_trainable_chunks(batch)
    v0 = p.value(o).detach()
    m = agent.update(batch)
    assert m["value_loss"] > 0 and m["explained_variance"] < 1.0, m
    v1 = p.value(o).detach()
    assert (v1 - ret).abs().mean() < (v0 - ret).abs().mean(), (v0, v1)


def test_init_noise_scale_zero_starts_every_chain_at_zero(ckpts):
    """init_noise_scale=0: stochastic acts start at x_0 = 0 (the deterministic act's start) and
    still explore through the chain's Gaussians, whose log-prob the update recomputes."""
    p = build(ckpts["pi0"], init_noise_scale=0.0)
    perturb(p)
    p.eval()
    o = obs()
    torch.manual_seed(0)
    a, b = p.act(o), p.act(o)
    assert torch.count_nonzero(a.extras["noise"]) == 0 and torch.count_nonzero(a.extras["chain"][:, 0]) == 0
    assert not torch.allclose(a.actions, b.actions)  # the step noise still explores
    with torch.no_grad():
        assert torch.allclose(p.log_prob(with_extras(o, a), a.actions), a.log_prob, atol=1e-4)
    with pytest.raises(ValueError, match="init_noise_scale"):
        build(ckpts["pi0"], init_noise_scale=1.5)
