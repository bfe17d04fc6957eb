"""OpenVLA-OFT discrete for on-policy RL, on the tiny checkpoint: the act-time and update-time
log-probs agree (records carry the tokens), the LoRA-off reference, the value head, and one
PPO update with GAE on the policy's own value head."""

import pytest
import torch

from agents.base import ReferencePolicy, ValuePolicy, capabilities_of
from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_openvla_oft

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_openvla_oft(tmp_path_factory.mktemp("oftrl") / "oft", SPEC)


def make(ckpt, **kw):
    kw.setdefault("lora_rank", 4)
    kw.setdefault("chunk_size", 4)
    return OpenVLAOFTDiscretePolicy(OpenVLAOFTDiscretePolicyConfig(checkpoint=str(ckpt), **kw), SPEC)


def obs(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"observation.state": torch.rand(b, 4, generator=g),
            "observation.images.image": torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g),
            "task": ["reach the red target", "reach the blue target"] * (b // 2)}


def perturb_adapters(p, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, q in p.named_parameters():
            if ".lora_B" in n:
                q.add_(scale * torch.randn(q.shape, generator=g).to(q.dtype))


def test_act_and_update_log_probs_agree_through_the_records(ckpt):
    p = make(ckpt, temperature=1.3)
    perturb_adapters(p)
    p.eval()
    torch.manual_seed(0)
    c = p.act(obs())  # eval mode, no grad: adapters folded into the weights for serving
    assert p.lora.folded
    batch = dict(obs(), **{"extra.action_tokens": c.extras["action_tokens"]})
    p.train()  # the update: adapters live, gradients on
    lp = p.log_prob(batch, c.actions)
    assert lp.requires_grad
    assert torch.allclose(lp.detach(), c.log_prob, atol=1e-4), (lp, c.log_prob)
    assert p.extras_ranges() == {"action_tokens": (0, 255)}  # ingest refuses other tokens
    # the per-token factors sum to the chunk's log-prob (token-level PPO ratios)
    tok = p.token_log_prob(batch, c.actions)
    assert tok.shape == (c.actions.shape[0], p.chunk_size * p.action_dim) and tok.requires_grad
    torch.testing.assert_close(tok.sum(-1), lp, rtol=0, atol=1e-5)
    # the executed actions alone re-discretise to the same tokens (bin centres)
    assert torch.allclose(p.log_prob(obs(), c.actions).detach(), c.log_prob, atol=1e-4)
    # bad tokens are named
    with pytest.raises(ValueError, match="action_tokens"):
        p.log_prob({**batch, "extra.action_tokens": c.extras["action_tokens"][:, :3]}, c.actions)
    with pytest.raises(ValueError, match="outside"):
        p.log_prob({**batch, "extra.action_tokens": c.extras["action_tokens"] + 256}, c.actions)


def test_reference_is_the_model_without_adapters(ckpt):
    p = make(ckpt)
    base = make(ckpt)  # same checkpoint and seed: LoRA B starts at zero, so it is the base model
    perturb_adapters(p)
    assert ReferencePolicy in capabilities_of(p)
    o = obs()
    tok = base.act(o, deterministic=True).extras["action_tokens"]
    with torch.no_grad():
        want = base.log_prob(o, tokens=tok)
        adapted = p.log_prob(o, tokens=tok)
        assert not torch.allclose(adapted, want, atol=1e-3)  # the adapters change the policy
        flags = {n: q.requires_grad for n, q in p.named_parameters()}
        for mode in (True, False):  # training mode, and eval mode where serving would fold
            p.train(mode)
            with p.reference():
                assert torch.allclose(p.log_prob(o, tokens=tok), want, atol=1e-5)
                assert not p.lora.folded
            assert {n: q.requires_grad for n, q in p.named_parameters()} == flags
            assert torch.allclose(p.log_prob(o, tokens=tok), adapted, atol=1e-4)


def test_value_head_trains_alone_and_travels_in_the_snapshot(ckpt):
    p = make(ckpt)
    assert ValuePolicy in capabilities_of(p)
    p.train()
    o = obs()
    v = p.value(o)
    assert v.shape == (4,) and torch.allclose(v, torch.zeros(4))  # zero-initialised output layer
    state = p.trainable_state_dict()
    assert any(k.startswith("value_head.") for k in state)
    target = torch.tensor([1.0, -1.0, 0.5, 0.0])
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-2)
    before = {n: q.detach().clone() for n, q in p.named_parameters() if ".lora_" in n}
    h = p.action_hidden(o)  # the hidden states are fixed when only the head trains
    losses = []
    for _ in range(40):
        loss = (p.value_head(h.detach()) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses
    # through value() the adapters get no gradient (value_detach)
    opt.zero_grad()
    (p.value(o) - target).pow(2).mean().backward()
    assert all(q.grad is None or not q.grad.any() for n, q in p.named_parameters() if ".lora_" in n)
    opt.step()
    # value_detach: the adapters got no gradient from the value loss
    assert all(torch.equal(q, before[n]) for n, q in p.named_parameters() if ".lora_" in n)
    # a policy without the head says so
    q = make(ckpt, value_head_dim=0)
    with pytest.raises(ValueError, match="no value head"):
        q.value(o)


def test_ppo_update_with_gae_on_the_policy_value_head(ckpt):
    from accelerate import Accelerator

    from agents.ppo.agent import PPOAgent, PPOConfig

    p = make(ckpt)
    p.train()
    torch.manual_seed(0)
    o = obs(8, seed=3)
    with torch.no_grad():
        c = p.act(o)
    cfg = PPOConfig(lr=1e-3, value_lr=1e-3, epochs=2, minibatch_size=4, kl_coef=0.05, kl_kind="k3")
    agent = PPOAgent(cfg, p, p, Accelerator(cpu=True))
    assert agent.token_level  # auto: OFT-discrete has per-token log-probs
    adv = torch.tensor([1.0, -1.0] * 4)
    batch = dict(o, action=c.actions, old_log_prob=c.log_prob, advantages=adv,
                 returns=torch.ones(8), **{"extra.action_tokens": c.extras["action_tokens"]})
    m = agent.update(batch)
    assert all(torch.isfinite(torch.tensor(float(x))) for x in m.values()), m
    assert m.get("kl", 0.0) >= 0.0
    with torch.no_grad():
        after = p.log_prob(o, tokens=c.extras["action_tokens"])
    # the positive-advantage chunks got likelier relative to the negative ones
    d = after - c.log_prob
    assert d[adv > 0].mean() > d[adv < 0].mean(), d
    assert p.value(o).abs().sum() > 0  # the value head moved towards the returns


def test_an_sft_start_loaded_as_init_trainable_is_the_kl_reference(ckpt, tmp_path):
    """RL after SFT: the reference is the SFT policy the run started from (its adapters and
    heads as loaded from ``policy.init_trainable``), not the model before SFT."""
    from safetensors.torch import save_file

    from agents.registry import build_policy

    sft = make(ckpt)
    perturb_adapters(sft, seed=5)
    path = tmp_path / "sft.safetensors"
    save_file({k: v.contiguous() for k, v in sft.trainable_state_dict().items()}, str(path))
    p = build_policy({"name": "openvla_oft_discrete", "checkpoint": str(ckpt), "lora_rank": 4, "chunk_size": 4,
                      "init_trainable": str(path)}, SPEC)
    o = obs()
    tok = p.act(o, deterministic=True).extras["action_tokens"]
    with torch.no_grad():
        at_start = p.log_prob(o, tokens=tok)
        base = make(ckpt).log_prob(o, tokens=tok)
        assert not torch.allclose(base, at_start, atol=1e-3)  # SFT changed the policy
        perturb_adapters(p, seed=6)  # RL moves it on
        moved = p.log_prob(o, tokens=tok)
        assert not torch.allclose(moved, at_start, atol=1e-3)
        with p.reference():
            torch.testing.assert_close(p.log_prob(o, tokens=tok), at_start, rtol=0, atol=1e-5)
        torch.testing.assert_close(p.log_prob(o, tokens=tok), moved, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mask_unexecuted", [True, False])
def test_chunks_cut_short_train_on_their_executed_actions_only(ckpt, mask_unexecuted):
    """Chunks of which only the first action ran (``chunk_steps`` 1, as with ``chunk.execute=1``
    or an episode ending there): not full chunks (``mask`` False), but the policy's own. With
    ``mask_unexecuted`` they train on the executed action's tokens, and what the later actions'
    tokens were cannot change the update; without it such chunks do not train at all."""
    from accelerate import Accelerator

    from agents.ppo.agent import PPOAgent, PPOConfig

    o = obs(8, seed=4)
    base = make(ckpt)
    with torch.no_grad():
        tok = base.act(o).extras["action_tokens"]
    per_action = tok.shape[1] // base.chunk_size
    other = tok.clone()
    other[:, per_action:] = (tok[:, per_action:] + 37) % 256  # the never-executed actions differ
    assert torch.equal(base.token_chunk_positions(tok.shape[1])[:per_action + 1],
                       torch.tensor([0] * per_action + [1]))
    start = {n: q.detach().clone() for n, q in base.named_parameters() if q.requires_grad}
    moved = []
    for tokens in (tok, other):
        torch.manual_seed(0)  # the same LoRA init both times
        p = make(ckpt)
        p.train()
        with torch.no_grad():
            behaviour = p.log_prob(o, tokens=tokens)  # fresh: importance weights 1 in both runs
        agent = PPOAgent(PPOConfig(lr=1e-3, epochs=1, minibatch_size=8, mask_unexecuted=mask_unexecuted),
                         p, None, Accelerator(cpu=True))
        assert agent.token_level
        agent.update(dict(o, action=torch.zeros(8, base.chunk_size, 2), old_log_prob=behaviour,
                          advantages=torch.tensor([1.0, -1.0] * 4), mask=torch.zeros(8, dtype=torch.bool),
                          own_chunk=torch.ones(8, dtype=torch.bool), chunk_steps=torch.ones(8, dtype=torch.long),
                          **{"extra.action_tokens": tokens}))
        moved.append({n: q.detach().clone() for n, q in p.named_parameters() if q.requires_grad})
    assert all(torch.allclose(moved[0][n], moved[1][n], atol=1e-7) for n in moved[0])
    lora_b = [n for n in moved[0] if ".lora_B" in n]  # zero at the start, whatever the seed
    trained = any(not torch.allclose(moved[0][n], start[n]) for n in lora_b)
    assert trained == mask_unexecuted


def test_a_round_of_partial_own_chunks_updates_through_the_learner(ckpt):
    """With ``chunk.execute`` below the chunk size every chunk is partial (``mask`` all False)
    but the policy's own: the on-policy learner must still run the update (token ratios train
    on the executed actions) and publish, not skip the round."""
    from accelerate import Accelerator

    from agents.ppo.on_policy import OnPolicyLearner, Round
    from agents.ppo.agent import PPOAgent, PPOConfig

    o = obs(8, seed=5)
    torch.manual_seed(0)
    p = make(ckpt)
    with torch.no_grad():
        tok = p.act(o).extras["action_tokens"]
        behaviour = p.log_prob(o, tokens=tok)
    p.train()
    batch = dict(o, action=torch.zeros(8, p.chunk_size, 2), old_log_prob=behaviour,
                 advantages=torch.tensor([1.0, -1.0] * 4), mask=torch.zeros(8, dtype=torch.bool),
                 own_chunk=torch.ones(8, dtype=torch.bool), chunk_steps=torch.full((8,), 2, dtype=torch.long),
                 **{"extra.action_tokens": tok})

    class OneRound:  # a collector that has one round ready (its queue reports nothing)
        queue = type("Queue", (), {"status": staticmethod(lambda: {})})()

        def __init__(self):
            self.rounds = [Round(batch, {"round_episodes": 2.0})]

        def collect(self, version):
            return self.rounds.pop() if self.rounds else None

    agent = PPOAgent(PPOConfig(lr=1e-3, epochs=1, minibatch_size=8), p, None, Accelerator(cpu=True))
    start = {n: q.detach().clone() for n, q in p.named_parameters() if ".lora_B" in n}
    learner = OnPolicyLearner(agent, OneRound())
    m = learner.step()
    assert m is not None and learner.updates == 1 and learner.should_publish() and learner.version == 1
    assert any(not torch.allclose(q, start[n]) for n, q in p.named_parameters() if n in start)
    # a round whose chunks are neither full nor the policy's own (a person drove them) is skipped
    learner.collector.rounds = [Round(dict(batch, own_chunk=torch.zeros(8, dtype=torch.bool)), {})]
    learner.step()
    assert learner.updates == 1 and not learner.should_publish()
