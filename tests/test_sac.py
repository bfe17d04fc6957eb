"""SAC losses on known inputs, the MLP policy's contract, and the agent's update/state."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from agents.base import (ActionChunk, BCPolicy, FeaturePolicy, LogProbPolicy, Policy, ReparamSampler,
                         capabilities_of)
from agents.common.critics import EnsembleCritic
from agents.common.encoders import ObsEncoder
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from agents.sac.agent import (
    SACAgent,
    SACConfig,
    actor_loss,
    critic_loss,
    soft_update,
    td_target,
    temperature_loss,
)
from data.core.spec import EnvSpec

torch.set_num_threads(1)

STATE_SPEC = EnvSpec(state_dim=5, action_dim=2, max_episode_steps=50)
PIXEL_SPEC = EnvSpec(state_dim=4, action_dim=3, cameras={"front": (32, 32, 3), "wrist": (24, 20, 3)},
                     max_episode_steps=20)
SMALL = MLPPolicyConfig(hidden_dims=(32, 32), cnn_channels=(8, 8), image_embed_dim=16,
                        state_embed_dim=16)


def obs_batch(spec: EnvSpec, b: int, *, prefix: str = "", scale: float = 1.0,
              gen: torch.Generator | None = None) -> dict:
    out = {prefix + "observation.state": scale * torch.randn(b, spec.state_dim, generator=gen)}
    for key in spec.image_keys:
        h, w, c = spec.cameras[key.split(".")[-1]]
        out[prefix + key] = torch.randint(0, 256, (b, h, w, c), dtype=torch.uint8, generator=gen)
    return out


def train_batch(spec: EnvSpec, b: int, *, seed: int = 0, chunk: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = obs_batch(spec, b, gen=g)
    batch.update(obs_batch(spec, b, prefix="next.", gen=g))
    shape = (b, spec.action_dim) if chunk == 1 else (b, chunk, spec.action_dim)
    batch["action"] = torch.rand(shape, generator=g) * 2 - 1
    batch["reward"] = torch.randn(b, generator=g)
    batch["terminated"] = torch.zeros(b, dtype=torch.bool)
    batch["truncated"] = torch.zeros(b, dtype=torch.bool)
    batch["intervened"] = torch.zeros(b, dtype=torch.bool)
    batch["policy_version"] = torch.zeros(b, dtype=torch.int64)
    batch["task"] = [""] * b
    return batch


def make_agent(spec: EnvSpec = STATE_SPEC, *, seed: int = 0, pcfg: MLPPolicyConfig = SMALL,
               **cfg) -> SACAgent:
    torch.manual_seed(seed)
    policy = MLPPolicy(pcfg, spec)
    sac = SACConfig(**{"batch_size": 16, "critic_hidden_dims": (32, 32), **cfg})
    return SACAgent(sac, policy, spec, Accelerator(cpu=True))


def repeat(batch):
    while True:
        yield batch


# -- losses on known inputs ------------------------------------------------------------------
def test_td_target_by_hand():
    reward = torch.tensor([1.0, 1.0, -0.5])
    terminated = torch.tensor([False, True, False])
    next_q = torch.tensor([[2.0, 3.0, 0.0], [4.0, 1.0, -1.0]])  # min: [2, 1, -1]
    next_logp = torch.tensor([0.5, -0.5, 1.0])
    got = td_target(reward, terminated, next_q, next_logp, alpha=0.2, gamma=0.9)
    want = torch.tensor([1 + 0.9 * (2 - 0.1), 1.0, -0.5 + 0.9 * (-1 - 0.2)])
    torch.testing.assert_close(got, want)
    no_ent = td_target(reward, terminated, next_q, next_logp, alpha=0.2, gamma=0.9,
                       backup_entropy=False)
    torch.testing.assert_close(no_ent, torch.tensor([1 + 0.9 * 2, 1.0, -0.5 + 0.9 * -1]))


def test_agent_bootstraps_on_truncation_but_not_on_termination():
    """Same batch, flagged terminated vs truncated: the terminated target is the reward alone,
    the truncated one bootstraps (and equals the not-done target)."""
    agent = make_agent()
    base = train_batch(STATE_SPEC, 32, seed=1)
    targets = {}
    for flag in ("none", "terminated", "truncated"):
        b = dict(base)
        if flag != "none":
            b[flag] = torch.ones(32, dtype=torch.bool)
        torch.manual_seed(7)  # same next-action noise for each variant
        with torch.no_grad():
            a, logp = agent.policy.sample(b, "next.")
            nq = agent.target_critic(b, a, "next.")
        targets[flag] = td_target(b["reward"], b["terminated"], nq, logp, alpha=agent.alpha,
                                  gamma=agent.cfg.gamma)
    torch.testing.assert_close(targets["terminated"], base["reward"])
    torch.testing.assert_close(targets["truncated"], targets["none"])
    assert (targets["truncated"] - base["reward"]).abs().min() > 1e-4

    # and the agent's own critic step reports the same target means
    for flag, want in (("terminated", base["reward"].mean()), ("truncated", targets["none"].mean())):
        b = dict(base)
        b[flag] = torch.ones(32, dtype=torch.bool)
        fresh = make_agent()
        torch.manual_seed(7)
        m = fresh.critic_step(b)
        assert float(m["target_q_mean"]) == pytest.approx(float(want), abs=1e-5)


def test_critic_loss_by_hand_and_no_gradient_into_target():
    q = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    target = torch.tensor([1.0, 1.0], requires_grad=True)
    loss = critic_loss(q, target)
    assert float(loss.detach()) == pytest.approx(0.5 + 6.5)  # member means of (0,1)^2 and (2,3)^2
    loss.backward()
    torch.testing.assert_close(q.grad, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    assert target.grad is None


def test_actor_loss_by_hand():
    q = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    logp = torch.tensor([0.5, 1.0])
    assert float(actor_loss(q, logp, 0.1, "mean")) == pytest.approx((0.05 - 1.5 + 0.1 - 2.5) / 2)
    assert float(actor_loss(q, logp, 0.1, "min")) == pytest.approx((0.05 - 1.0 + 0.1 - 2.0) / 2)


@pytest.mark.parametrize("logp, direction", [(5.0, +1), (-5.0, -1)])
def test_temperature_loss_moves_alpha_toward_target_entropy(logp, direction):
    """Entropy (-logp) below the target (-2) must raise alpha; above it must lower alpha."""
    log_alpha = torch.nn.Parameter(torch.tensor(0.0))
    logps = torch.full((8,), logp)
    loss = temperature_loss(log_alpha, logps, target_entropy=-2.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(logp - 2.0))
    assert float(log_alpha.grad) == pytest.approx(-(logp - 2.0))
    with torch.no_grad():
        log_alpha -= 0.1 * log_alpha.grad
    assert math.copysign(1, float(log_alpha.detach())) == direction


def test_soft_update_arithmetic():
    online, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in online.parameters():
            p.fill_(1.0)
        for p in target.parameters():
            p.fill_(0.0)
    soft_update(target, online, 0.1)
    for p in target.parameters():
        torch.testing.assert_close(p, torch.full_like(p, 0.1))
    soft_update(target, online, 0.1)
    for p in target.parameters():
        torch.testing.assert_close(p, torch.full_like(p, 0.19))
    for p in online.parameters():
        torch.testing.assert_close(p, torch.ones_like(p))


# -- the policy -------------------------------------------------------------------------------
def test_policy_is_a_policy_and_actions_are_bounded():
    torch.manual_seed(0)
    pol = MLPPolicy(SMALL, STATE_SPEC)
    assert isinstance(pol, Policy)
    assert capabilities_of(pol) == {ReparamSampler, LogProbPolicy, BCPolicy, FeaturePolicy}
    # huge observations push the pre-tanh mean far out: actions must still be in [-1, 1]
    obs = obs_batch(STATE_SPEC, 64, scale=1e4)
    for det in (False, True):
        out = pol.act(obs, deterministic=det)
        assert isinstance(out, ActionChunk)
        assert out.actions.shape == (64, 1, 2) and out.actions.dtype == torch.float32
        assert out.actions.abs().max() <= 1.0
        assert torch.isfinite(out.actions).all()
        assert set(out.extras_with_log_prob()) == set(pol.extras_spec())
        assert torch.isfinite(out.log_prob).all()
    # every act carries its declared extras: log_prob of the returned actions, the noise
    obs = obs_batch(STATE_SPEC, 64)
    for det in (False, True):
        out = pol.act(obs, deterministic=det)
        torch.testing.assert_close(out.log_prob, pol.log_prob(obs, out.actions), atol=2e-3, rtol=1e-3)
        assert out.extras["noise"].shape == (64, 1, 2) and bool((out.extras["noise"] == 0).all()) == det
    a, logp = pol.sample(obs)
    assert a.shape == (64, 1, 2) and logp.shape == (64,) and a.abs().max() <= 1.0
    d1 = pol.act(obs, deterministic=True).actions
    d2 = pol.act(obs, deterministic=True).actions
    torch.testing.assert_close(d1, d2)


def test_sample_and_log_prob_agree_and_sample_is_reparameterised():
    torch.manual_seed(0)
    pol = MLPPolicy(SMALL, STATE_SPEC)
    obs = obs_batch(STATE_SPEC, 128)
    a, logp = pol.sample(obs)
    torch.testing.assert_close(pol.log_prob(obs, a.detach()), logp.detach(), atol=2e-3, rtol=1e-4)
    (a.sum() + logp.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pol.head.parameters())


def test_log_prob_is_a_normalised_density_on_the_square():
    """exp(log_prob) over a fine grid of [-1, 1]^2 integrates to ~1 for each observation."""
    torch.manual_seed(0)
    pol = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), log_std_min=-1.0, log_std_max=0.5), STATE_SPEC)
    n = 400
    g = (torch.arange(n, dtype=torch.float64) + 0.5) / n * 2 - 1
    grid = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2).float()
    for _ in range(3):
        obs = obs_batch(STATE_SPEC, 1)
        rep = {k: v.expand(grid.shape[0], -1) for k, v in obs.items()}
        with torch.no_grad():
            mass = pol.log_prob(rep, grid).double().exp().sum() * (2 / n) ** 2
        assert float(mass) == pytest.approx(1.0, abs=0.02)


def test_bc_loss_fits_demonstrated_actions():
    torch.manual_seed(0)
    pol = MLPPolicy(SMALL, STATE_SPEC)
    batch = obs_batch(STATE_SPEC, 64)
    batch["action"] = torch.tanh(batch["observation.state"][:, :2])  # a learnable target
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    first = float(pol.bc_loss(batch).detach())
    for _ in range(300):
        loss = pol.bc_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(pol.bc_loss(batch).detach()) < first - 2.0
    err = (pol.act(batch, deterministic=True).actions[:, 0] - batch["action"]).abs().mean()
    assert float(err) < 0.1


def test_trainable_state_dict_is_a_detached_cpu_copy_that_round_trips():
    torch.manual_seed(0)
    pol = MLPPolicy(SMALL, PIXEL_SPEC)
    sd = pol.trainable_state_dict()
    assert sd and all(v.device.type == "cpu" and not v.requires_grad for v in sd.values())
    before = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(1.0)  # the snapshot must not follow the live weights
    for k in sd:
        torch.testing.assert_close(sd[k], before[k])
    torch.manual_seed(1)
    other = MLPPolicy(SMALL, PIXEL_SPEC)
    other.load_trainable_state_dict(pol.trainable_state_dict())
    obs = obs_batch(PIXEL_SPEC, 4)
    torch.testing.assert_close(other.act(obs, deterministic=True).actions,
                               pol.act(obs, deterministic=True).actions)


def test_pixel_and_state_policy_and_critic_shapes():
    torch.manual_seed(0)
    pol = MLPPolicy(SMALL, PIXEL_SPEC)
    assert len(pol.encoder.cams) == 2
    obs = obs_batch(PIXEL_SPEC, 6)
    assert pol.act(obs).actions.shape == (6, 1, 3)
    a, logp = pol.sample(obs)
    assert a.shape == (6, 1, 3) and logp.shape == (6,)
    assert pol.log_prob(obs, a.detach()).shape == (6,)
    batch = dict(obs, action=a.detach())
    loss = pol.bc_loss(batch)
    assert loss.shape == ()
    loss.backward()
    for cam in pol.encoder.cams.values():  # each camera's CNN gets gradient
        assert cam.convs[0].weight.grad.abs().sum() > 0
    critic = EnsembleCritic(ObsEncoder(PIXEL_SPEC, SMALL), 3, num_critics=3, hidden_dims=(16,))
    assert critic(obs, a.detach()).shape == (3, 6)
    with pytest.raises(ValueError, match="critic scores actions of 3 values"):
        critic(obs, torch.zeros(6, 2, 3))


def test_chunked_policy_shapes():
    torch.manual_seed(0)
    cfg = MLPPolicyConfig(hidden_dims=(16,), chunk_size=4)
    pol = MLPPolicy(cfg, STATE_SPEC)
    obs = obs_batch(STATE_SPEC, 5)
    assert pol.act(obs).actions.shape == (5, 4, 2)
    a, logp = pol.sample(obs)
    assert a.shape == (5, 4, 2) and logp.shape == (5,)
    torch.testing.assert_close(pol.log_prob(obs, a.detach()), logp.detach(), atol=2e-3, rtol=1e-4)
    agent = make_agent(pcfg=cfg)
    assert agent.target_entropy == -8.0
    m = agent.update(repeat(train_batch(STATE_SPEC, 16, chunk=4)))
    assert all(math.isfinite(v) for v in m.values())


# -- the agent --------------------------------------------------------------------------------
def test_sac_refuses_a_policy_without_reparam_sample():
    class NoSample(MLPPolicy):
        sample = None  # the class does not provide the ReparamSampler capability

    with pytest.raises(ValueError, match="does not provide ReparamSampler"):
        SACAgent(SACConfig(), NoSample(SMALL, STATE_SPEC), STATE_SPEC, Accelerator(cpu=True))
    assert SACConfig().requires == (ReparamSampler,)
    assert SACConfig(critic_encoder="policy").requires == (ReparamSampler, FeaturePolicy)


def test_update_draws_utd_ratio_batches_and_changes_every_network():
    agent = make_agent(utd_ratio=3)
    drawn = []

    def batches():
        i = 0
        while True:
            drawn.append(i)
            yield train_batch(STATE_SPEC, 16, seed=i)
            i += 1

    before = agent.state_dict()
    m = agent.update(batches())
    assert len(drawn) == 3
    assert {"critic_loss", "actor_loss", "temperature_loss", "alpha", "entropy", "q_mean"} <= set(m)
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    after = agent.state_dict()
    for part in ("policy", "critic", "target_critic"):
        assert any(not torch.equal(before[part][k], after[part][k]) for k in before[part]), part
    assert not torch.equal(before["log_alpha"], after["log_alpha"])
    assert after["num_updates"] == 1


def test_target_critic_tracks_critic_by_tau_per_critic_step():
    agent = make_agent(utd_ratio=2, tau=0.25)
    tgt0 = {k: v.clone() for k, v in agent.target_critic.state_dict().items()}
    crit_hist = []
    orig = agent.critic_step

    def spy(batch):  # record the online critic right after each of its updates
        out = orig(batch)
        crit_hist.append({k: v.clone() for k, v in agent._critic_raw.state_dict().items()})
        return out

    agent.critic_step = spy
    # replicate the arithmetic: t1 = .75 t0 + .25 c1 ; t2 = .75 t1 + .25 c2
    agent.update(repeat(train_batch(STATE_SPEC, 16)))
    for k, t in agent.target_critic.state_dict().items():
        t1 = 0.75 * tgt0[k] + 0.25 * crit_hist[0][k]
        torch.testing.assert_close(t, 0.75 * t1 + 0.25 * crit_hist[1][k])


def test_num_min_qs_takes_a_subset_of_the_ensemble():
    agent = make_agent(num_critics=5, num_min_qs=2)
    q = torch.arange(5.0).unsqueeze(1).expand(5, 3)
    seen = set()
    for _ in range(50):
        sub = agent._target_q_subset(q)
        assert sub.shape == (2, 3)
        rows = tuple(sorted(int(r) for r in sub[:, 0]))
        assert len(set(rows)) == 2
        seen.add(rows)
    assert len(seen) > 3  # random subsets, not a fixed pair
    assert make_agent(num_critics=3)._target_q_subset(q[:3]).shape == (3, 3)


def test_state_dict_round_trip_restores_identical_outputs_and_training():
    a = make_agent(seed=0, utd_ratio=2)
    it = repeat(train_batch(STATE_SPEC, 16, seed=3))
    for _ in range(5):
        a.update(it)
    state = a.state_dict()
    assert set(state) == {"policy", "critic", "target_critic", "log_alpha", "actor_opt",
                          "critic_opt", "temp_opt", "num_updates"}
    b = make_agent(seed=123, utd_ratio=2)
    b.load_state_dict(state)
    obs = obs_batch(STATE_SPEC, 8)
    act = train_batch(STATE_SPEC, 8, seed=9)["action"]
    torch.testing.assert_close(b.policy.act(obs, deterministic=True).actions,
                               a.policy.act(obs, deterministic=True).actions)
    torch.testing.assert_close(b.critic(obs, act), a.critic(obs, act))
    torch.testing.assert_close(b.target_critic(obs, act), a.target_critic(obs, act))
    assert b.alpha == a.alpha and b.num_updates == a.num_updates == 5
    # optimizer moments restored too: the next update is bit-identical
    nb = train_batch(STATE_SPEC, 16, seed=4)
    torch.manual_seed(42)
    ma = a.update(repeat(nb))
    torch.manual_seed(42)
    mb = b.update(repeat(nb))
    assert ma == mb
    for part in ("policy", "critic", "target_critic"):
        sa, sb = a.state_dict()[part], b.state_dict()[part]
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    # the snapshot taken before that update is independent of both live agents
    assert state["num_updates"] == 5
    live = a.state_dict()
    assert any(not torch.equal(state["critic"][k], live["critic"][k]) for k in state["critic"])
    assert float(state["critic_opt"]["state"][0]["step"]) == 10  # 5 updates x utd 2
    assert float(live["critic_opt"]["state"][0]["step"]) == 12
    assert float(b.state_dict()["critic_opt"]["state"][0]["step"]) == 12


def test_pixel_agent_updates():
    agent = make_agent(PIXEL_SPEC, utd_ratio=2, num_critics=3, num_min_qs=2)
    before = {k: v.clone() for k, v in agent._critic_raw.encoder.state_dict().items()}
    m = agent.update(repeat(train_batch(PIXEL_SPEC, 8)))
    assert all(math.isfinite(v) for v in m.values())
    after = agent._critic_raw.encoder.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if "cams" in k)
