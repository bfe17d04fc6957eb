"""Noise-space SAC (DSRL) for PI0: the update by hand, what stays frozen, the pairing check,
and the served noise against the stored ``extra.noise`` through the real learner and actor.

Model: a tiny, architecturally faithful PI0 (tools/make_tiny_checkpoints.make_pi0), chunk 4,
on point_reach's spec (state 4, action 2, one 32x32 camera, an instruction).

The learning run is tests/test_noise_sac_learning.py (gated: several minutes; its tool
tools/experiments/sac_learning.py). The feature cache is tested here.
"""

from __future__ import annotations

import copy
import math
import threading
import time

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from tandem_testutil import ROOT, free_port

H, A = 4, 2
ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0
    from tools.record_demos import env_config

    spec = env_spec(env_config(ENV_O))
    return make_pi0(tmp_path_factory.mktemp("pi0") / "pi0", spec, chunk_size=H), spec


_BASES: dict = {}


def make_agent(ckpt, **cfg):
    """An agent around the module's one frozen PI0 (LoRA 4: the adapters must stay frozen
    too); sharing it is safe because nothing may change it (the tests check that)."""
    from agents.sac.noise_builder import NoiseSACBuilder
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from agents.sac.noise import NoiseSACConfig

    path, spec = ckpt
    torch.manual_seed(0)
    if path not in _BASES:
        _BASES[path] = Pi0Policy(Pi0PolicyConfig(checkpoint=str(path), chunk_size=H, lora_rank=4, device="cpu"), spec)
    base = _BASES[path]
    c = NoiseSACConfig(critic_hidden_dims=(32, 32), noise_actor_hidden_dims=(32, 32),
                  **{"utd_ratio": 1, **cfg})
    builder = NoiseSACBuilder(c)
    nets = builder.make_networks(spec.with_extras(base.extras_spec()), base, torch.device("cpu"))
    from agents.sac.noise import NoiseSACAgent

    return NoiseSACAgent(c, nets.policy, nets.spec, Accelerator(cpu=True), critic=nets.critic)


def hand_batch(policy, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = {}
    for pre in ("", "next."):
        b[pre + "observation.state"] = torch.rand(n, 4, generator=g)
        b[pre + "observation.images.image"] = torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8)
    b["task"] = ["reach the red target"] * n
    b["action"] = torch.rand(n, H, A, generator=g) * 2 - 1
    b["reward"] = (torch.rand(n, H, generator=g) > 0.7).float()
    b["step_mask"] = torch.ones(n, H, dtype=torch.bool)
    b["step_mask"][0, 2:] = False
    b["n_steps"] = b["step_mask"].sum(1)
    b["terminated"] = torch.tensor([True] + [False] * (n - 1))
    b["extra.noise"] = torch.randn(n, H, policy.full_dims, generator=g)
    return b


def frozen_state(agent):
    return {k: v.clone() for k, v in agent.policy.base.state_dict().items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_features_are_computed_once_per_batch_and_match_per_observation(ckpt):
    from agents.sac.noise_actor import pi0_features
    from agents.sac.noise import attach_features

    agent = make_agent(ckpt)
    p = agent.policy
    b = hand_batch(p)
    calls = []
    embed = p.base.inner.model.embed_prefix

    def counted(*a, **k):  # an observer: counts the frozen prefix passes
        calls.append(a[0][0].shape[0])
        return embed(*a, **k)

    p.base.inner.model.embed_prefix = counted
    try:
        fb = attach_features(p, b)
    finally:
        del p.base.inner.model.embed_prefix
    assert calls == [10], "obs and next obs go through the backbone together, once"
    assert fb["features"].shape == (5, p.feature_dim) and not fb["features"].requires_grad
    torch.testing.assert_close(fb["features"], pi0_features(p.base, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fb["next.features"], pi0_features(p.base, b, "next."), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fb["features"], fb["next.features"])


def test_feature_cache_runs_the_backbone_once_per_distinct_observation(ckpt):
    from agents.sac.noise import FeatureCache, attach_features

    p = make_agent(ckpt).policy
    b1, b2 = hand_batch(p, seed=0), hand_batch(p, seed=1)
    mixed = {k: (torch.cat([b1[k][:3], b2[k][:2]]) if torch.is_tensor(b1[k]) else b1[k]) for k in b1}
    cache, calls = FeatureCache(max_rows=100), []
    embed = p.base.inner.model.embed_prefix

    def counted(*a, **k):  # an observer: counts the rows of each frozen prefix pass
        calls.append(a[0][0].shape[0])
        return embed(*a, **k)

    p.base.inner.model.embed_prefix = counted
    try:
        f1 = attach_features(p, b1, cache)
        f1_again = attach_features(p, b1, cache)
        fm = attach_features(p, mixed, cache)
    finally:
        del p.base.inner.model.embed_prefix
    assert calls == [10, 4], "seen observations are not recomputed; only b2's 2 obs + 2 next obs are"
    assert cache.hits == 10 + 6 and len(cache) == 14
    for k in ("features", "next.features"):
        torch.testing.assert_close(f1_again[k], f1[k])
        torch.testing.assert_close(fm[k], attach_features(p, mixed)[k], atol=1e-5, rtol=1e-5)
    small = FeatureCache(max_rows=3)
    small.features(p, {k: v for k, v in b1.items() if k.startswith("observation.") or k == "task"})
    assert len(small) == 3, "the cache is bounded"


def test_critic_target_is_computed_in_noise_space(ckpt):
    from agents.sac.noise import attach_features

    agent = make_agent(ckpt, gamma=0.9, init_temperature=0.3)
    b = attach_features(agent.policy, hand_batch(agent.policy))
    actor, critic, target = (copy.deepcopy(m) for m in (agent._actor_raw, agent._critic_raw, agent.target_critic))
    alpha, g = 0.3, 0.9
    with torch.no_grad():
        torch.manual_seed(7)
        w2, logp2 = actor.sample(b["next.features"])  # noise of the next chunk, [B, H, d]
        assert w2.shape == (5, H, A)
        v = target(b, w2, "next.").min(0).values - alpha * logp2
        powers = g ** torch.arange(H, dtype=torch.float32)
        r = (b["reward"] * b["step_mask"].float() * powers).sum(1)
        y = r + g ** b["n_steps"].float() * (~b["terminated"]).float() * v
        q = critic(b, b["extra.noise"][..., :A])  # the stored noise is the action
        want = (q - y).pow(2).mean(1).sum()
    torch.manual_seed(7)
    got = agent.critic_step(b)
    assert math.isclose(float(got["critic_loss"]), float(want), rel_tol=1e-5)
    assert math.isclose(float(got["target_q_mean"]), float(y.mean()), rel_tol=1e-5, abs_tol=1e-6)
    # the critic read the noise, not the executed actions; only the actor's dims of it
    agent2 = make_agent(ckpt, gamma=0.9, init_temperature=0.3)
    agent2._critic_raw.load_state_dict(critic.state_dict())
    agent2.target_critic.load_state_dict(target.state_dict())
    agent2._actor_raw.load_state_dict(actor.state_dict())
    b2 = dict(b, action=-b["action"])
    b2["extra.noise"] = b["extra.noise"].clone()
    b2["extra.noise"][..., A:] = 5.0  # the flow's padded dims: not the actor's
    torch.manual_seed(7)
    assert math.isclose(float(agent2.critic_step(b2)["critic_loss"]), float(want), rel_tol=1e-5)
    b3 = dict(b)
    b3["extra.noise"] = b["extra.noise"] + 1.0
    agent2._critic_raw.load_state_dict(critic.state_dict())
    agent2.target_critic.load_state_dict(target.state_dict())
    torch.manual_seed(7)
    assert not math.isclose(float(agent2.critic_step(b3)["critic_loss"]), float(want), rel_tol=1e-3)


def test_actor_loss_goes_through_the_critic_and_frozen_parts_stay_bit_identical(ckpt):
    from agents.sac.noise import attach_features

    agent = make_agent(ckpt, init_temperature=1e-3, actor_lr=3e-3)
    b = attach_features(agent.policy, hand_batch(agent.policy))
    base0, critic0 = frozen_state(agent), copy.deepcopy(agent._critic_raw.state_dict())
    actor0 = copy.deepcopy(agent._actor_raw)
    with torch.no_grad():
        torch.manual_seed(3)
        w, logp = actor0.sample(b["features"])
        want = (1e-3 * logp - agent._critic_raw(b, w).mean(0)).mean()
        q_before = agent._critic_raw(b, actor0.mean_noise(b["features"])).mean()
    torch.manual_seed(3)
    m = agent.actor_step(b)
    assert math.isclose(float(m["actor_loss"]), float(want), rel_tol=1e-5)
    assert not torch.equal(agent._actor_raw.head.weight, actor0.head.weight)
    for _ in range(40):
        agent.actor_step(b)
    assert_same(agent._critic_raw.state_dict(), critic0)  # the actor step never moves the critic
    assert_same(frozen_state(agent), base0)  # nor PI0 (LoRA adapters included)
    with torch.no_grad():
        q_after = agent._critic_raw(b, agent._actor_raw.mean_noise(b["features"])).mean()
    assert q_after > q_before + 1e-3, (float(q_before), float(q_after))


def test_update_trains_only_the_noise_actor_critic_and_temperature(ckpt):
    agent = make_agent(ckpt, utd_ratio=2)
    p = agent.policy
    base0, pub0 = frozen_state(agent), p.trainable_state_dict()
    critic0, target0 = copy.deepcopy(agent._critic_raw), copy.deepcopy(agent.target_critic)
    batches = iter([hand_batch(p, seed=1), hand_batch(p, seed=2)])
    m = agent.update(batches)
    assert m["num_updates"] == 1 and math.isfinite(m["critic_loss"]) and math.isfinite(m["actor_loss"])
    assert_same(frozen_state(agent), base0)
    assert all(not q.requires_grad for q in p.base.parameters())
    pub = p.trainable_state_dict()
    assert pub.keys() == pub0.keys() and all(k.startswith("noise_actor.") for k in pub)
    assert any(not torch.equal(pub[k], pub0[k]) for k in pub)
    assert not torch.equal(agent._critic_raw.net[0].weight, critic0.net[0].weight)
    # soft update: the target moved by tau toward the critic, twice (one per critic step)
    assert not torch.equal(agent.target_critic.net[0].weight, target0.net[0].weight)
    # checkpoint round trip
    agent2 = make_agent(ckpt, utd_ratio=2)
    agent2.load_state_dict(agent.state_dict())
    assert_same(agent2.policy.trainable_state_dict(), pub)


def test_noise_action_space_with_a_policy_without_a_noise_hook_fails_at_start_up():
    from agents import registry

    with pytest.raises(ValueError, match=r"'sac_noise' cannot train policy 'mlp'.*NoiseConditionedPolicy"):
        registry.check_algo_policy({"name": "sac_noise"}, "mlp")
    registry.check_algo_policy({"name": "sac_noise"}, "pi0")  # the pair that works
    with pytest.raises(ValueError, match="ReparamSampler"):
        registry.check_algo_policy({"name": "sac"}, "pi0")  # action-space SAC still refuses PI0
    with pytest.raises(ValueError, match="unknown algorithm 'sac_latent'"):
        registry.check_algo_policy({"name": "sac_latent"}, "pi0")
    # the learner entry point refuses the pair before building any model
    from hydra import compose, initialize_config_dir

    from learner.app import Learner

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="learner", overrides=["algo=sac_noise", "policy=mlp"])
    with pytest.raises(ValueError, match="NoiseConditionedPolicy"):
        Learner(cfg)


# -- the real learner and actor ---------------------------------------------------------------
def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=overrides)


@pytest.mark.slow
def test_served_noise_is_the_stored_extra_noise_and_drives_pi0(ckpt, tmp_path):
    from actor.app import Actor
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from data.core.weights import from_wire
    from data.store import read_episodes
    from learner.app import Learner

    path, spec = ckpt
    run_dir, port, pub = tmp_path / "run", free_port(), free_port()
    common = [*ENV_O, f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=2.0", "transport.heartbeat_s=0.5", "policy=pi0", f"policy.checkpoint={path}",
              f"policy.chunk_size={H}", "policy.lora_rank=0", "policy.device=cpu"]
    learner = Learner(_compose("learner", common + [
        "algo=sac_noise", "algo.learning_starts=8", "algo.batch_size=8", "algo.utd_ratio=1",
        "algo.publish_every=2", "algo.critic_hidden_dims=[32,32]", "algo.noise_actor_hidden_dims=[32,32]",
        "device=cpu", "logging.wandb=disabled", "trainer.num_threads=1", "buffer.commit_interval_s=0.2",
        "buffer.video=false"]))
    assert learner.spec.extras == {"noise": ("float32", (H, learner.algo.policy.full_dims))}
    v, arrays, bf16 = learner.weights.latest()
    snaps = {v: from_wire(arrays, bf16)}
    publish = learner.weights.publish

    def observed(state, version=None):  # an observer of what goes out
        out = publish(state, version)
        snaps[out] = {k: t.detach().cpu().clone() for k, t in state.items()}
        return out

    learner.weights.publish = observed
    err: list[BaseException] = []
    th = threading.Thread(target=lambda: err.append(None) if learner.run() is None else None, daemon=True)
    th.start()
    replies = []
    try:
        for det, episodes in ((False, 6), (True, 2)):
            actor = Actor(_compose("actor", common + ["actor_id=a0", "spool.fsync=false", "spool.batch_size=8",
                                                      "drain_s=30", f"deterministic={str(det).lower()}",
                                                      f"max_episodes={episodes}"]))
            act = actor._act

            def tap(arrays, tasks, deterministic, act=act):
                actions, version, extras = act(arrays, tasks, deterministic)
                replies.append({"obs": {k: np.array(a) for k, a in arrays.items()}, "task": tasks[0],
                                "actions": np.array(actions[0]), "version": version, "det": deterministic,
                                "noise": np.array(extras["extra.noise"][0])})
                return actions, version, extras

            actor._act = tap
            actor.run()
            deadline = time.monotonic() + 60
            while not det and learner.weights.version < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        learner.stop()
        th.join(60)
    assert learner.algo.updates > 0 and max(r["version"] for r in replies) >= 2
    assert all(set(s) and all(k.startswith("noise_actor.") for k in s) for s in snaps.values())
    # the stored chunk starts are the replies, in order, with the same noise
    stored = []
    for ep in sorted(read_episodes(run_dir / "dataset"), key=lambda e: int(e.columns["actor_episode"][0])):
        c = ep.columns
        for s in np.flatnonzero(c["chunk_start"]):
            stored.append((np.asarray(c["extra.noise"][s]), np.asarray(c["action"][s]), int(c["policy_version"][s])))
    assert len(stored) == len(replies)
    for (noise, action, version), r in zip(stored, replies):
        np.testing.assert_array_equal(noise, r["noise"])
        np.testing.assert_array_equal(action, r["actions"][0])
        assert version == r["version"]
    # every reply's chunk is PI0 started from the reply's noise; its noise lives in the actor's
    # dims; a deterministic reply's noise is the named version's mean noise
    base = Pi0Policy(Pi0PolicyConfig(checkpoint=str(path), chunk_size=H, lora_rank=0, device="cpu"), spec).eval()
    wrapper = learner.builder.wrap_policy(Pi0Policy(Pi0PolicyConfig(checkpoint=str(path), chunk_size=H,
                                                                    lora_rank=0, device="cpu"), spec)).eval()
    for r in replies[:: max(1, len(replies) // 12)] + [x for x in replies if x["det"]][:4]:
        obs = {k: torch.from_numpy(v) for k, v in r["obs"].items()}
        obs["task"] = [r["task"]]
        noise = torch.from_numpy(r["noise"])[None]
        assert (noise[..., A:] == 0).all() and noise[..., :A].abs().max() <= 1.5
        np.testing.assert_allclose(base.act(obs, noise=noise).actions[0].numpy(), r["actions"], atol=1e-5)
        if r["det"]:
            wrapper.load_trainable_state_dict(snaps[r["version"]])
            want = wrapper.act(obs, deterministic=True).extras["noise"][0].numpy()
            np.testing.assert_allclose(r["noise"], want, atol=1e-5)
