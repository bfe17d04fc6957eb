"""PPO / GRPO losses on known inputs (agents/ppo/agent.py) and the agents' updates on the MLP policy."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from agents.grpo.agent import GRPOAgent, GRPOConfig, group_advantages
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from agents.ppo.agent import (PPOAgent, PPOConfig, entropy_bonus, policy_loss, truncated_is_weights,
                        value_loss)
from data.core.spec import DEFAULT_FLOAT_RANGE
from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec

SPEC = EnvSpec(state_dim=3, action_dim=2)
SMALL = MLPPolicyConfig(hidden_dims=(32, 32), chunk_size=2)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# -- losses -------------------------------------------------------------------------------------
def test_policy_loss_clips_asymmetrically_and_zeroes_the_right_gradients():
    ratio = t([1.5, 0.5, 0.5, 1.5, 1.25])
    logp = ratio.log().requires_grad_(True)
    adv = t([1.0, 1.0, -1.0, -1.0, 1.0])
    loss, m = policy_loss(logp, torch.zeros(5), adv, 0.2, 0.28)
    # per sample: max(-A r, -A clip(r, 0.8, 1.28))
    per = [-1.28, -0.5, 0.8, 1.5, -1.25]
    assert float(loss.detach()) == pytest.approx(sum(per) / 5, abs=1e-6)
    loss.backward()
    # A > 0 above 1 + high and A < 0 below 1 - low: no gradient; the other sides keep -A r
    torch.testing.assert_close(logp.grad, t([0.0, -0.5, 0.0, 1.5, -1.25]) / 5)
    assert float(m["clip_frac"]) == pytest.approx(2 / 5)
    assert float(m["ratio_mean"]) == pytest.approx(float(ratio.mean()), abs=1e-6)
    log_r = ratio.log()
    assert float(m["approx_kl"]) == pytest.approx(float((ratio - 1 - log_r).mean()), abs=1e-6)
    # symmetric 0.2 clips the 1.25 ratio too
    _, m_sym = policy_loss(ratio.log(), torch.zeros(5), adv, 0.2, 0.2)
    assert float(m_sym["clip_frac"]) == pytest.approx(3 / 5)


def test_policy_loss_mask_and_importance_weights():
    logp = t([0.0, 0.0, 0.0]).requires_grad_(True)
    adv = t([1.0, 2.0, 3.0])
    loss, _ = policy_loss(logp, torch.zeros(3), adv, 0.2, 0.2, mask=t([1, 0, 1], torch.bool),
                          is_weight=t([0.5, 1.0, 2.0]))
    assert float(loss.detach()) == pytest.approx(-(0.5 * 1 + 2.0 * 3) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([-0.25, 0.0, -3.0]))


def test_token_level_ratios_clip_each_token_where_the_chunk_ratio_would_clip_everything():
    # 2 chunks of 8 tokens, each token's ratio 1.1: within the clip range one by one, while the
    # chunk's ratio 1.1^8 = 2.14 is far outside it (A > 0: no gradient at chunk level)
    tok = torch.full((2, 8), math.log(1.1), requires_grad=True)
    adv = t([1.0, -1.0])
    loss, m = policy_loss(tok, torch.zeros(2, 8), adv, 0.2, 0.28)
    # per token max(-A r, -A clip(r)): chunk 0 -> -1.1, chunk 1 -> +1.1; mean over 16 tokens = 0
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(tok.grad, torch.stack([torch.full((8,), -1.1 / 16), torch.full((8,), 1.1 / 16)]))
    assert float(m["clip_frac"]) == 0.0
    chunk = tok.detach().sum(-1).requires_grad_(True)
    closs, cm = policy_loss(chunk, torch.zeros(2), adv, 0.2, 0.28)
    closs.backward()
    assert chunk.grad[0] == 0.0 and float(cm["clip_frac"]) == pytest.approx(0.5)
    # a chunk's mask, advantage and weight reach all of its tokens; the mean is over real tokens
    tok2 = torch.zeros(3, 4, requires_grad=True)
    loss2, _ = policy_loss(tok2, torch.zeros(3, 4), t([1.0, 2.0, 3.0]), 0.2, 0.2,
                           mask=t([1, 0, 1], torch.bool), is_weight=t([0.5, 1.0, 2.0]))
    assert float(loss2.detach()) == pytest.approx(-(0.5 * 1 + 2.0 * 3) / 2)
    loss2.backward()
    torch.testing.assert_close(tok2.grad[1], torch.zeros(4))
    torch.testing.assert_close(tok2.grad[2], torch.full((4,), -6.0 / 8))


def test_ratio_level_config_and_auto_choice():
    with pytest.raises(ValueError, match="ratio_level"):
        PPOConfig(ratio_level="episode")
    with pytest.raises(ValueError, match="is_truncation"):
        PPOConfig(ratio_level="token", is_truncation=None)
    pol = MLPPolicy(SMALL, SPEC)  # per-chunk log-probs only: auto -> chunk, token -> refused
    assert not PPOAgent(PPOConfig(), pol, None, Accelerator(cpu=True)).token_level
    with pytest.raises(ValueError, match="TokenLogProbPolicy"):
        PPOAgent(PPOConfig(ratio_level="token"), pol, None, Accelerator(cpu=True))
    assert GRPOConfig(ratio_level="chunk").ppo_config().ratio_level == "chunk"


def test_dual_clip_caps_negative_advantage_terms_only():
    # ratios 5 and 2 with A = -1: the 5 is capped at 3 (no gradient), the 2 is under the cap;
    # with A = +1 a ratio of 5 is clipped at 1.28 as before (dual clip never touches A > 0)
    ratio = torch.tensor([5.0, 2.0, 5.0], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, m = policy_loss(ratio.log(), torch.zeros(3), adv, 0.2, 0.28, dual_clip=3.0)
    assert torch.isclose(loss, torch.tensor((3.0 + 2.0 - 1.28) / 3))
    loss.backward()
    assert ratio.grad[0] == 0 and ratio.grad[2] == 0 and ratio.grad[1] > 0
    assert torch.isclose(m["dual_clip_frac"], torch.tensor(1 / 3))
    plain, _ = policy_loss(torch.tensor([5.0, 2.0, 5.0]).log(), torch.zeros(3), adv, 0.2, 0.28)
    assert torch.isclose(plain, torch.tensor((5.0 + 2.0 - 1.28) / 3))
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(dual_clip=0.5)


def test_value_loss_clipping():
    values = t([1.0, 1.0]).requires_grad_(True)
    old, returns = t([0.0, 0.0]), t([2.0, 0.0])
    loss = value_loss(values, old, returns, 0.2)
    # sample 0: max((1-2)^2, (0.2-2)^2) = 3.24 (clipped, no gradient); sample 1: max(1, 0.04) = 1
    assert float(loss.detach()) == pytest.approx(0.5 * (3.24 + 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(values.grad, t([0.0, 0.5]))
    assert float(value_loss(values.detach(), old, returns, None)) == pytest.approx(0.5)


def test_truncated_is_weights_cap_and_detach():
    old = t([math.log(0.5), math.log(1.5), math.log(5.0)]).requires_grad_(True)
    w = truncated_is_weights(torch.zeros(3), old, 2.0)
    torch.testing.assert_close(w, t([0.5, 1.5, 2.0]))
    assert not w.requires_grad
    torch.testing.assert_close(truncated_is_weights(torch.zeros(3), old, None)[2], t(5.0))


def test_entropy_bonus_value_and_score_function_gradient():
    lp = t([1.0, 3.0]).requires_grad_(True)
    ent = entropy_bonus(lp)
    assert float(ent.detach()) == pytest.approx(-2.0)
    sf = entropy_bonus(lp, score_function=True)
    assert float(sf.detach()) == pytest.approx(-2.0)
    sf.backward()
    torch.testing.assert_close(lp.grad, t([0.5, -0.5]))  # -(lp - mean lp) / N


def test_configs_validate():
    with pytest.raises(ValueError, match="estimator"):
        PPOConfig(estimator="vtrace")
    with pytest.raises(ValueError, match="kl_kind"):
        PPOConfig(kl_kind="k9")
    with pytest.raises(ValueError, match="clip_low"):
        PPOConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="score"):
        GRPOConfig(score="reward")
    g = GRPOConfig()
    assert (g.clip_low, g.clip_high, g.kl_coef, g.group_size) == (0.2, 0.28, 0.0, 8)
    assert g.ppo_config().value_coef == 0.0 and not g.ppo_config().normalize_advantages


# -- the agents ---------------------------------------------------------------------------------
class ValueNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(SPEC.state_dim, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, obs):
        return self.net(obs[OBS_STATE]).squeeze(-1)


class RefMLP(MLPPolicy):
    """An MLP policy with a reference: its initial head (like a LoRA model with adapters off)."""

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.ref_head = copy.deepcopy(self.head).requires_grad_(False)
        self.reference_calls = 0

    @contextlib.contextmanager
    def reference(self):
        self.reference_calls += 1
        head, self.head = self.head, self.ref_head
        try:
            yield
        finally:
            self.head = head


def rollout_batch(policy, n=64, seed=0):
    torch.manual_seed(seed)
    obs = {OBS_STATE: torch.randn(n, SPEC.state_dim)}
    chunk = policy.act(obs)
    adv = torch.cat([torch.ones(n // 2), -torch.ones(n // 2)])
    return {**obs, "action": chunk.actions, "old_log_prob": chunk.log_prob,
            "advantages": adv, "returns": adv * 2.0}


def test_act_log_prob_equals_recomputed_log_prob():
    torch.manual_seed(0)
    policy = MLPPolicy(SMALL, SPEC)
    obs = {OBS_STATE: torch.randn(16, SPEC.state_dim)}
    chunk = policy.act(obs)
    assert chunk.actions.shape == (16, 2, 2) and chunk.log_prob.shape == (16,)
    with torch.no_grad():
        torch.testing.assert_close(policy.log_prob(obs, chunk.actions), chunk.log_prob,
                                   atol=1e-4, rtol=1e-5)
        # tanh saturated (pre-tanh draws ~12): the float32 actions are 1 exactly, and the
        # behaviour log-prob is still the one the update recomputes (that of the pre-tanh
        # draw is far from it: the importance weights of such chunks were ~0)
        policy.head.weight.zero_()
        policy.head.bias[:4] = 12.0
        policy.head.bias[4:] = -50.0
        chunk = policy.act(obs)
        assert bool((chunk.actions.abs() == 1.0).all())
        torch.testing.assert_close(policy.log_prob(obs, chunk.actions), chunk.log_prob)
        # farther out (mean 40 at the smallest std) the recomputed log-prob leaves the wire's
        # float range (ingest would refuse the record and drop its episode): stored at the floor
        policy.head.bias[:4] = 40.0
        chunk = policy.act(obs)
        assert bool((policy.log_prob(obs, chunk.actions) < DEFAULT_FLOAT_RANGE[0]).all())
        assert bool((chunk.log_prob == DEFAULT_FLOAT_RANGE[0]).all())


@pytest.mark.parametrize("with_value", [False, True])
def test_ppo_update_moves_log_probs_with_the_sign_of_the_advantage(with_value):
    torch.manual_seed(0)
    policy = MLPPolicy(SMALL, SPEC)
    value = ValueNet() if with_value else None
    cfg = PPOConfig(epochs=4, minibatch_size=16, lr=3e-3, value_lr=1e-2, entropy_coef=0.01)
    agent = PPOAgent(cfg, policy, value, Accelerator(cpu=True))
    batch = rollout_batch(policy)
    obs = {OBS_STATE: batch[OBS_STATE]}
    with torch.no_grad():
        before = policy.log_prob(obs, batch["action"])
        v_before = value(obs) if with_value else None
    metrics = agent.update(batch)
    with torch.no_grad():
        after = policy.log_prob(obs, batch["action"])
    delta = after - before
    assert float(delta[:32].mean()) > 0.05 and float(delta[32:].mean()) < -0.05
    assert (delta[:32] > 0).float().mean() > 0.8 and (delta[32:] < 0).float().mean() > 0.8
    for k in ("policy_loss", "clip_frac", "approx_kl", "ratio_mean", "entropy", "grad_norm",
              "is_weight_mean"):
        assert math.isfinite(metrics[k]), k
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # fresh rollouts
    assert metrics["num_updates"] == 1.0
    if with_value:
        with torch.no_grad():
            v_after = value(obs)
        target = batch["returns"]
        assert (v_after - target).pow(2).mean() < (v_before - target).pow(2).mean()
        assert "value_loss" in metrics and "explained_variance" in metrics
    else:
        assert "value_loss" not in metrics


def test_stale_rollouts_are_reweighted_with_a_cap():
    torch.manual_seed(0)
    policy = MLPPolicy(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(epochs=1, minibatch_size=64, is_truncation=2.0), policy, None,
                     Accelerator(cpu=True))
    batch = rollout_batch(policy)
    batch["old_log_prob"] = batch["old_log_prob"] + math.log(4.0)   # behaviour 4x likelier
    assert agent.update(dict(batch))["is_weight_mean"] == pytest.approx(0.25, rel=1e-3)
    batch["old_log_prob"] = batch["old_log_prob"] - 2 * math.log(4.0)  # 4x less likely: capped
    assert agent.update(batch)["is_weight_mean"] == pytest.approx(2.0)


def test_kl_to_the_reference_policy_is_computed_once_per_batch():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="ReferencePolicy"):
        PPOAgent(PPOConfig(kl_kind="k3", kl_coef=0.1), MLPPolicy(SMALL, SPEC), None,
                 Accelerator(cpu=True))
    policy = RefMLP(SMALL, SPEC)
    cfg = PPOConfig(kl_kind="k3", kl_coef=0.1, epochs=2, minibatch_size=16, lr=3e-3)
    agent = PPOAgent(cfg, policy, None, Accelerator(cpu=True))
    batch = rollout_batch(policy)
    m1 = agent.update(batch)
    assert policy.reference_calls == 1
    m2 = agent.update(batch)
    assert policy.reference_calls == 2
    assert 0.0 <= m1["kl"] < m2["kl"]   # starts at the reference, then moves away


def test_state_dict_round_trip():
    torch.manual_seed(0)
    policy = MLPPolicy(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(epochs=1, minibatch_size=32), policy, ValueNet(),
                     Accelerator(cpu=True))
    batch = rollout_batch(policy)
    agent.update(batch)
    state = agent.state_dict()
    other = PPOAgent(PPOConfig(epochs=1, minibatch_size=32), MLPPolicy(SMALL, SPEC), ValueNet(),
                     Accelerator(cpu=True))
    other.load_state_dict(state)
    obs = {OBS_STATE: batch[OBS_STATE]}
    with torch.no_grad():
        torch.testing.assert_close(other.policy.log_prob(obs, batch["action"]),
                                   policy.log_prob(obs, batch["action"]))
        torch.testing.assert_close(other.value_fn(obs), agent.value_fn(obs))
    assert other.num_updates == 1
    torch.manual_seed(1)
    a = agent.update(batch)
    torch.manual_seed(1)
    b = other.update(batch)
    assert a["policy_loss"] == pytest.approx(b["policy_loss"], rel=1e-5)


def test_grpo_agent_on_group_advantages():
    torch.manual_seed(0)
    cfg = GRPOConfig(group_size=4, epochs=2, minibatch_size=16, lr=1e-3)
    # 4 groups of 4 episodes: all fail, all succeed, two mixed
    scores = t([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1])
    groups = torch.arange(4).repeat_interleave(4)
    adv, keep, dropped = group_advantages(cfg, scores, groups)
    assert dropped == 2 and keep.tolist() == [False] * 8 + [True] * 8
    assert adv[:8].abs().max() == 0 and adv[8] > 0 > adv[9] and adv[14] < 0 < adv[15]
    policy = MLPPolicy(SMALL, SPEC)
    agent = GRPOAgent(cfg, policy, Accelerator(cpu=True))
    batch = rollout_batch(policy)
    batch.pop("returns")
    obs = {OBS_STATE: batch[OBS_STATE]}
    with torch.no_grad():
        before = policy.log_prob(obs, batch["action"])
    metrics = agent.update(batch)
    with torch.no_grad():
        delta = policy.log_prob(obs, batch["action"]) - before
    assert float(delta[:32].mean()) > 0 > float(delta[32:].mean())
    assert "value_loss" not in metrics and agent.name == "grpo"


class ValueMLP(MLPPolicy):
    """An MLP policy with its own value head (a ValuePolicy)."""

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.value_head = nn.Linear(self.encoder.out_dim, 1)

    def value(self, obs):
        return self.value_head(self.encoder(obs)).squeeze(-1)


def test_a_value_policy_trains_its_own_head_with_the_policy_optimizer():
    torch.manual_seed(0)
    policy = ValueMLP(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(epochs=4, minibatch_size=16, lr=1e-2), policy, policy,
                     Accelerator(cpu=True))
    assert agent.value_opt is None and agent.has_critic
    batch = rollout_batch(policy)
    obs = {OBS_STATE: batch[OBS_STATE]}
    with torch.no_grad():
        err0 = (policy.value(obs) - batch["returns"]).pow(2).mean()
    metrics = agent.update(batch)
    with torch.no_grad():
        err1 = (policy.value(obs) - batch["returns"]).pow(2).mean()
    assert err1 < err0 and "value_loss" in metrics
    assert set(agent.state_dict()) == {"policy", "opt", "num_updates"}


class NamedValueMLP(ValueMLP):
    """... that names its value head (``value_parameters``), as the VLA policies do."""

    def value_parameters(self):
        return list(self.value_head.parameters())


def test_a_policy_value_head_trains_at_value_lr_not_the_policy_lr():
    # a VLA's policy lr (1e-5) would leave a fresh value head untrained: the head the
    # policy names gets value_lr in a parameter group of its own
    torch.manual_seed(0)
    policy = NamedValueMLP(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(lr=1e-6, value_lr=1e-2, epochs=4, minibatch_size=16, value_clip=None),
                     policy, policy, Accelerator(cpu=True))
    lrs = sorted(g["lr"] for g in agent.opt.param_groups)
    assert lrs == [1e-6, 1e-2]
    head = {id(p) for p in policy.value_head.parameters()}
    for g in agent.opt.param_groups:
        assert all((id(p) in head) == (g["lr"] == 1e-2) for p in g["params"])
    before = {n: q.detach().clone() for n, q in policy.named_parameters()}
    agent.update(rollout_batch(policy))  # 4 epochs x 4 Adam steps
    moved = {n: float((q.detach() - before[n]).abs().max()) for n, q in policy.named_parameters()}
    assert min(v for n, v in moved.items() if n.startswith("value_head.")) > 1e-3, moved
    assert max(v for n, v in moved.items() if not n.startswith("value_head.")) < 1e-4, moved


@pytest.mark.parametrize("target_kl,epochs_run", [(None, 6), (1e-6, 1), (10.0, 6)])
def test_target_kl_stops_the_epochs_of_a_round_early(target_kl, epochs_run):
    """After each pass, the pass's mean approx_kl is compared with target_kl: a tiny target stops
    after the first pass (the step there moved the policy), a huge one never stops."""
    torch.manual_seed(0)
    policy = MLPPolicy(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(epochs=6, minibatch_size=16, lr=3e-3, target_kl=target_kl), policy, None,
                     Accelerator(cpu=True))
    batch = rollout_batch(policy)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    m = agent.update(batch)
    assert m["epochs"] == epochs_run
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    if target_kl == 1e-6:
        assert m["approx_kl"] > target_kl  # why it stopped
    with pytest.raises(ValueError, match="target_kl"):
        PPOConfig(target_kl=0.0)


class _Rounds:
    """A collector that hands the learner the same fresh batch every round (the learner's lr
    schedule is under test, not the collector)."""

    def __init__(self, batch):
        self.batch = batch

    def collect(self, version):
        from agents.ppo.on_policy import Round
        return Round(batch=self.batch, metrics={})


def test_lr_warmup_raises_the_policy_lr_linearly_and_leaves_the_value_lr():
    from agents.ppo.on_policy import OnPolicyLearner

    torch.manual_seed(0)
    policy = NamedValueMLP(SMALL, SPEC)
    agent = PPOAgent(PPOConfig(lr=1e-3, value_lr=1e-2, epochs=1, minibatch_size=64), policy, policy,
                     Accelerator(cpu=True))
    learner = OnPolicyLearner(agent, _Rounds(rollout_batch(policy)), lr_warmup=4)
    learner._queue_metrics = dict  # no rollout queue behind the stand-in collector
    before = {n: q.detach().clone() for n, q in policy.named_parameters() if not n.startswith("value_head.")}
    lrs, first_step = [], None
    for _ in range(6):
        m = learner.step()
        lrs.append(m["lr"])
        assert agent.opt.param_groups[1]["lr"] == 1e-2  # the value head's group keeps value_lr
        if first_step is None:  # one Adam step moves each weight by at most about its lr
            first_step = max(float((q.detach() - before[n]).abs().max())
                             for n, q in policy.named_parameters() if n in before)
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert 1e-4 < first_step <= 2.5e-4 * 1.01
    assert learner.updates == 6 and learner.version == 6
