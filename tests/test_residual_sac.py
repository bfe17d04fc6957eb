"""Residual SAC (PLD style) for OpenVLA-OFT's L1 head: the executed chunk, the update by hand,
what stays frozen, the pairing checks, and the served chunks against the stored records
through the real learner and actor.

Model: a tiny, architecturally faithful OFT (tools/make_tiny_checkpoints.make_openvla_oft),
chunk 4 x 2, dataset statistics at point_reach's ranges, on point_reach's spec (state 4,
action 2, one 32x32 camera, an instruction). The learning proof is
tests/test_residual_sac_learning.py (gated).
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
    from tools.make_tiny_checkpoints import make_openvla_oft
    from tools.experiments.oft_grpo_demo import env_ranged_stats
    from tools.record_demos import env_config

    spec = env_spec(env_config(ENV_O))
    path = make_openvla_oft(tmp_path_factory.mktemp("oft") / "oft", spec, chunk_size=H, image_size=32)
    env_ranged_stats(path, spec.action_dim, spec.state_dim)
    return path, spec


def make_base(ckpt, lora_rank=4):
    from agents.registry import build_policy

    path, spec = ckpt
    torch.manual_seed(0)
    return build_policy({"name": "openvla_oft", "checkpoint": str(path), "chunk_size": H, "lora_rank": lora_rank,
                         "device": "cpu"}, spec)


_BASES: dict = {}


def make_agent(ckpt, **cfg):
    """An agent around the module's one frozen OFT (LoRA 4: the adapters must stay frozen too);
    sharing it is safe because nothing may change it (the tests check that)."""
    from agents.sac.residual import ResidualSACAgent, ResidualSACConfig
    from agents.sac.residual_builder import ResidualSACBuilder

    path, spec = ckpt
    if path not in _BASES:
        _BASES[path] = make_base(ckpt)
    base = _BASES[path]
    torch.manual_seed(0)
    c = ResidualSACConfig(critic_hidden_dims=(32, 32), residual_actor_hidden_dims=(32, 32),
                          **{"utd_ratio": 1, **cfg})
    nets = ResidualSACBuilder(c).make_networks(spec, base, torch.device("cpu"))
    return ResidualSACAgent(c, nets.policy, nets.spec.with_extras(nets.policy.extras_spec()), Accelerator(cpu=True),
                            critic=nets.critic)


def hand_batch(n=5, seed=0):
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
    b["extra.residual"] = torch.rand(n, H, A, generator=g) * 2 - 1
    return b


def frozen_state(agent):
    return {k: v.clone() for k, v in agent.policy.base.state_dict().items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def obs_of(b, prefix=""):
    out = {k[len(prefix):]: v for k, v in b.items() if k.startswith(prefix + "observation.")}
    out["task"] = b["task"]
    return out


def test_executed_chunk_is_the_clipped_base_plus_scaled_residual(ckpt):
    agent = make_agent(ckpt, residual_scale=0.8)
    p = agent.policy.eval()
    obs = obs_of(hand_batch(n=6))
    base = make_base(ckpt).eval().act(obs).actions  # a separately built copy of the base
    torch.manual_seed(1)
    c = p.act(obs)
    r = c.extras["residual"]
    assert c.actions.shape == r.shape == (6, H, A) and r.abs().max() <= 1
    torch.testing.assert_close(c.actions, (base + 0.8 * r).clamp(-1, 1), rtol=0, atol=0)
    assert ((base + 0.8 * r).abs() > 1).any(), "the clip is exercised"
    # the untrained actor's mean residual is ~0: its deterministic chunk is the base's
    d = p.act(obs, deterministic=True)
    assert (d.actions - base).abs().max() < 0.02
    # the features carry the base chunk, computed in the same single forward
    torch.testing.assert_close(p.base_chunk(p.features(obs)), base, rtol=0, atol=0)


def test_features_are_computed_once_per_batch_and_cached_per_observation(ckpt):
    from agents.sac.noise import FeatureCache, attach_features
    from agents.sac.residual_actor import oft_features

    p = make_agent(ckpt).policy
    b1, b2 = hand_batch(seed=0), hand_batch(seed=1)
    calls = []
    hidden = p.base.hidden

    def counted(inputs):  # an observer: counts the rows of each frozen VLA pass
        calls.append(inputs[0].shape[0])
        return hidden(inputs)

    p.base.hidden = counted
    cache = FeatureCache(max_rows=100)
    try:
        fb = attach_features(p, b1)
        f1 = attach_features(p, b1, cache)
        f1_again = attach_features(p, b1, cache)
        mixed = {k: (torch.cat([b1[k][:3], b2[k][:2]]) if torch.is_tensor(b1[k]) else b1[k]) for k in b1}
        attach_features(p, mixed, cache)
    finally:
        del p.base.hidden
    assert calls == [10, 10, 4], "obs + next obs in one pass; seen observations are not recomputed"
    assert fb["features"].shape == (5, p.feature_dim) and not fb["features"].requires_grad
    torch.testing.assert_close(fb["features"], oft_features(p.base, b1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fb["next.features"], oft_features(p.base, b1, "next."), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f1_again["features"], f1["features"])


def test_critic_target_is_computed_on_the_residual(ckpt):
    from agents.sac.noise import attach_features

    agent = make_agent(ckpt, gamma=0.9, init_temperature=0.3)
    b = attach_features(agent.policy, hand_batch())
    actor, critic, target = (copy.deepcopy(m) for m in (agent._actor_raw, agent._critic_raw, agent.target_critic))
    alpha, g = 0.3, 0.9
    with torch.no_grad():
        torch.manual_seed(7)
        r2, logp2 = actor.sample(b["next.features"])
        assert r2.shape == (5, H, A) and r2.abs().max() <= 1
        v = target(b, r2, "next.").min(0).values - alpha * logp2
        powers = g ** torch.arange(H, dtype=torch.float32)
        rew = (b["reward"] * b["step_mask"].float() * powers).sum(1)
        y = rew + g ** b["n_steps"].float() * (~b["terminated"]).float() * v
        q = critic(b, b["extra.residual"])  # the stored residual is the SAC action
        want = (q - y).pow(2).mean(1).sum()
    torch.manual_seed(7)
    got = agent.critic_step(b)
    assert math.isclose(float(got["critic_loss"]), float(want), rel_tol=1e-5)
    assert math.isclose(float(got["target_q_mean"]), float(y.mean()), rel_tol=1e-5, abs_tol=1e-6)
    # the critic reads the residual, not the executed chunk in `action`
    agent2 = make_agent(ckpt, gamma=0.9, init_temperature=0.3)
    for dst, src in ((agent2._critic_raw, critic), (agent2.target_critic, target), (agent2._actor_raw, actor)):
        dst.load_state_dict(src.state_dict())
    torch.manual_seed(7)
    assert math.isclose(float(agent2.critic_step(dict(b, action=-b["action"]))["critic_loss"]), float(want),
                        rel_tol=1e-5)
    agent2._critic_raw.load_state_dict(critic.state_dict())
    agent2.target_critic.load_state_dict(target.state_dict())
    torch.manual_seed(7)
    moved = dict(b, **{"extra.residual": -b["extra.residual"]})
    assert not math.isclose(float(agent2.critic_step(moved)["critic_loss"]), float(want), rel_tol=1e-3)


def test_actor_step_goes_through_the_critic_and_the_base_stays_bit_identical(ckpt):
    from agents.sac.noise import attach_features

    agent = make_agent(ckpt, init_temperature=1e-3, actor_lr=3e-3)
    b = attach_features(agent.policy, hand_batch())
    base0, critic0 = frozen_state(agent), copy.deepcopy(agent._critic_raw.state_dict())
    actor0 = copy.deepcopy(agent._actor_raw)
    with torch.no_grad():
        torch.manual_seed(3)
        r, logp = actor0.sample(b["features"])
        want = (1e-3 * logp - agent._critic_raw(b, r).mean(0)).mean()
        q_before = agent._critic_raw(b, actor0.mean_noise(b["features"])).mean()
    torch.manual_seed(3)
    m = agent.actor_step(b)
    assert math.isclose(float(m["actor_loss"]), float(want), rel_tol=1e-5) and "residual_abs_mean" in m
    for _ in range(40):
        agent.actor_step(b)
    assert_same(agent._critic_raw.state_dict(), critic0)  # the actor step never moves the critic
    assert_same(frozen_state(agent), base0)  # nor the OFT (LoRA adapters and heads included)
    with torch.no_grad():
        q_after = agent._critic_raw(b, agent._actor_raw.mean_noise(b["features"])).mean()
    assert q_after > q_before + 1e-3, (float(q_before), float(q_after))


def test_update_trains_only_the_residual_actor_critic_and_temperature(ckpt):
    agent = make_agent(ckpt, utd_ratio=2)
    p = agent.policy
    obs = obs_of(hand_batch(seed=3))
    base0, pub0, chunk0 = frozen_state(agent), p.trainable_state_dict(), p.base.act(obs).actions
    critic0 = copy.deepcopy(agent._critic_raw)
    for i in range(3):
        m = agent.update(iter([hand_batch(seed=10 + 2 * i), hand_batch(seed=11 + 2 * i)]))
    assert m["num_updates"] == 3 and math.isfinite(m["critic_loss"]) and math.isfinite(m["actor_loss"])
    assert_same(frozen_state(agent), base0)
    assert torch.equal(p.base.act(obs).actions, chunk0), "the base's chunks are bit-identical after updates"
    assert all(not q.requires_grad for q in p.base.parameters())
    pub = p.trainable_state_dict()
    assert pub.keys() == pub0.keys() and all(k.startswith("residual_actor.") for k in pub)
    assert any(not torch.equal(pub[k], pub0[k]) for k in pub)
    assert not torch.equal(agent._critic_raw.net[0].weight, critic0.net[0].weight)
    agent2 = make_agent(ckpt, utd_ratio=2)
    agent2.load_state_dict(agent.state_dict())
    assert_same(agent2.policy.trainable_state_dict(), pub)
    state = dict(agent.state_dict(), action_space="noise")
    with pytest.raises(ValueError, match="not of residual-space SAC"):
        agent2.load_state_dict(state)


def test_bad_pairs_fail_at_start_up_and_plain_sac_ignores_the_residual_keys():
    from hydra import compose, initialize_config_dir

    from agents import registry
    from agents.sac.residual_builder import ResidualSACBuilder
    from agents.sac.builder import SACBuilder
    from learner.app import Learner

    algo = {"name": "sac_residual"}
    registry.check_algo_policy(algo, "openvla_oft")  # the pairs that work
    registry.check_algo_policy(algo, "mlp")
    with pytest.raises(ValueError, match=r"cannot train policy 'pi0'.*neither L1ChunkPolicy.*nor MeanChunkPolicy"):
        registry.check_algo_policy(algo, "pi0")
    with pytest.raises(ValueError, match=r"'openvla_oft_discrete'.*continuous L1-head.*head_kind='discrete'"):
        registry.check_algo_policy(algo, "openvla_oft_discrete")
    with pytest.raises(ValueError, match="residual_scale and residual_init_std must be > 0"):
        registry.build_builder({**algo, "residual_scale": 0.0})
    assert isinstance(registry.build_builder({**algo, "residual_scale": 0.2}), ResidualSACBuilder)

    def cfg(*o):
        with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
            return compose(config_name="learner", overrides=list(o))

    # the residual keys are sac_residual's own: plain SAC's yaml has none
    assert isinstance(registry.build_builder(cfg("algo=sac").algo), SACBuilder)
    b = registry.build_builder(cfg("algo=sac_residual", "algo.residual_scale=0.25").algo)
    assert isinstance(b, ResidualSACBuilder) and b.cfg.residual_scale == 0.25
    with pytest.raises(ValueError, match=r"cannot train policy 'openvla_oft_discrete'"):
        Learner(cfg("algo=sac_residual", "policy=openvla_oft_discrete"))
    with pytest.raises(ValueError, match="L1ChunkPolicy"):
        Learner(cfg("algo=sac_residual", "policy=pi0"))


def test_mlp_base_chunk_is_its_mean_and_the_residual_is_added_to_it():
    """An MLP base (image + instruction, point_reach_vl's spec): features are its encoder's
    and its deterministic chunk; the executed chunk is clip(tanh(mean) + scale * r)."""
    from agents.registry import build_policy
    from agents.sac.residual import ResidualSACConfig
    from agents.sac.residual_builder import ResidualSACBuilder
    from envs.registry import env_spec
    from tools.record_demos import env_config

    spec = env_spec(env_config(["env=point_reach_vl"]))
    torch.manual_seed(0)
    mlp = build_policy({"name": "mlp", "hidden_dims": [16, 16], "chunk_size": 2, "task_embed_dim": 8}, spec)
    builder = ResidualSACBuilder(ResidualSACConfig(residual_scale=0.5, residual_actor_hidden_dims=(16, 16)))
    p = builder.make_networks(spec, mlp, torch.device("cpu")).policy.eval()
    assert p.feature_dim == mlp.feature_dim + 2 * spec.action_dim
    g = torch.Generator().manual_seed(0)
    obs = {"observation.state": torch.rand(5, spec.state_dim, generator=g) * 2 - 1,
           "observation.images.image": torch.randint(0, 256, (5, 32, 32, 3), generator=g, dtype=torch.uint8),
           "task": ["reach the red target", "reach the green target"] * 2 + ["reach the red target"]}
    base = mlp.act(obs, deterministic=True).actions
    f = p.features(obs)
    torch.testing.assert_close(f[:, :mlp.feature_dim], mlp.features(obs), rtol=0, atol=0)
    torch.testing.assert_close(p.base_chunk(f), base, rtol=0, atol=0)
    torch.manual_seed(1)
    c = p.act(obs)
    torch.testing.assert_close(c.actions, (base + 0.5 * c.extras["residual"]).clamp(-1, 1), rtol=0, atol=0)
    assert (p.act(obs, deterministic=True).actions - base).abs().max() < 0.02  # untrained: ~the base
    assert all(not q.requires_grad for q in mlp.parameters())  # frozen
    assert set(p.trainable_state_dict()) == {"residual_actor." + k for k in p.residual_actor.state_dict()}


# -- the real learner and actor ---------------------------------------------------------------
def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=overrides)


@pytest.mark.slow
def test_served_chunk_is_the_clipped_base_plus_scaled_stored_residual(ckpt, tmp_path):
    from actor.app import Actor
    from data.core.weights import from_wire
    from data.store import read_episodes
    from learner.app import Learner

    path, spec = ckpt
    scale = 0.6
    run_dir, port, pub = tmp_path / "run", free_port(), free_port()
    common = [*ENV_O, f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=2.0", "transport.heartbeat_s=0.5", "policy=openvla_oft",
              f"policy.checkpoint={path}", f"policy.chunk_size={H}", "policy.lora_rank=0", "policy.device=cpu"]
    learner = Learner(_compose("learner", common + [
        "algo=sac_residual", f"algo.residual_scale={scale}", "algo.learning_starts=8",
        "algo.batch_size=8", "algo.utd_ratio=1", "algo.publish_every=2", "algo.critic_hidden_dims=[32,32]",
        "algo.residual_actor_hidden_dims=[32,32]", "device=cpu", "logging.wandb=disabled", "trainer.num_threads=1",
        "buffer.commit_interval_s=0.2", "buffer.video=false"]))
    assert learner.spec.extras == {"residual": ("float32", (H, A))}
    v, arrays, bf16 = learner.weights.latest()
    snaps = {v: from_wire(arrays, bf16)}
    publish = learner.weights.publish

    def observed(state, version=None):  # an observer of what goes out
        out = publish(state, version)
        snaps[out] = {k: t.detach().cpu().clone() for k, t in state.items()}
        return out

    learner.weights.publish = observed
    th = threading.Thread(target=learner.run, daemon=True)
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
                                "residual": np.array(extras["extra.residual"][0])})
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
    assert all(set(s) and all(k.startswith("residual_actor.") for k in s) for s in snaps.values())
    # the stored chunk starts are the replies, in order, with the same residual
    stored = []
    for ep in sorted(read_episodes(run_dir / "dataset"), key=lambda e: int(e.columns["actor_episode"][0])):
        c = ep.columns
        for s in np.flatnonzero(c["chunk_start"]):
            stored.append((np.asarray(c["extra.residual"][s]), np.asarray(c["action"][s]), int(c["policy_version"][s])))
    assert len(stored) == len(replies)
    for (residual, action, version), r in zip(stored, replies):
        np.testing.assert_array_equal(residual, r["residual"])
        np.testing.assert_array_equal(action, r["actions"][0])
        assert version == r["version"]
    # every reply's chunk is clip(base + scale * residual) with the base a separately built OFT;
    # a deterministic reply's residual is the named version's mean residual
    base = make_base(ckpt, lora_rank=0).eval()
    wrapper = learner.builder.wrap_policy(make_base(ckpt, lora_rank=0)).eval()
    moved = 0
    for r in replies[:: max(1, len(replies) // 12)] + [x for x in replies if x["det"]][:4]:
        obs = {k: torch.from_numpy(v) for k, v in r["obs"].items()}
        obs["task"] = [r["task"]]
        res = torch.from_numpy(r["residual"])[None]
        assert res.abs().max() <= 1
        a_base = base.act(obs).actions
        np.testing.assert_allclose((a_base + scale * res).clamp(-1, 1)[0].numpy(), r["actions"], atol=1e-6)
        moved += bool((a_base[0].numpy() != r["actions"]).any())
        if r["det"]:
            wrapper.load_trainable_state_dict(snaps[r["version"]])
            want = wrapper.act(obs, deterministic=True).extras["residual"][0].numpy()
            np.testing.assert_allclose(r["residual"], want, atol=1e-6)
    assert moved > 0, "the residual changes what is executed"
