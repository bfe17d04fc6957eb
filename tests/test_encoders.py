"""The pooled image encoder (shapes, size, one backbone call for all cameras) and SAC with a
shared encoder (the critic trains the policy's encoder, the actor reuses detached features,
the conv backbone runs once per observation and network in an update)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from agents.common.encoders import EncoderConfig, ObsEncoder, SpatialLearnedEmbeddings
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from agents.sac.agent import SACAgent, SACConfig, make_critic
from data.core.spec import EnvSpec
from test_sac import obs_batch, repeat, train_batch

torch.set_num_threads(1)

HIL_SPEC = EnvSpec(state_dim=18, action_dim=4, cameras={"front": (128, 128, 3), "wrist": (128, 128, 3)},
                   max_episode_steps=100)
SMALL_SPEC = EnvSpec(state_dim=4, action_dim=3, cameras={"front": (40, 40, 3), "wrist": (40, 40, 3)},
                     max_episode_steps=20)
POOL = MLPPolicyConfig(hidden_dims=(32, 32), cnn_channels=(8, 8, 8), image_embed_dim=16,
                       state_embed_dim=16, image_encoder="pool", pool_features=4)


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_pool_encoder_is_small_and_has_the_flatten_encoders_output():
    flat = ObsEncoder(HIL_SPEC, EncoderConfig())
    pool = ObsEncoder(HIL_SPEC, EncoderConfig(image_encoder="pool"))
    assert pool.out_dim == flat.out_dim == 64 + 2 * 50
    obs = obs_batch(HIL_SPEC, 3)
    out = pool(obs)
    assert out.shape == (3, pool.out_dim) and torch.isfinite(out).all()
    # two 128x128 cameras: the flattening linear layers are ~5M parameters each
    assert n_params(flat) > 10_000_000
    assert n_params(pool) < 150_000
    # one backbone for both cameras, one spatial pooling + head per camera
    assert len(pool.pooled.pools) == 2 and not pool.cams


def test_pool_encoder_runs_the_backbone_once_for_same_shape_cameras_and_separately_otherwise():
    calls = []
    enc = ObsEncoder(SMALL_SPEC, POOL)
    enc.pooled.backbone.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    enc(obs_batch(SMALL_SPEC, 5))
    assert calls == [10]  # both cameras stacked into one call
    mixed = EnvSpec(state_dim=4, action_dim=3, cameras={"a": (40, 40, 3), "b": (32, 24, 3)},
                    max_episode_steps=20)
    enc2 = ObsEncoder(mixed, POOL)
    calls.clear()
    enc2.pooled.backbone.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    assert enc2(obs_batch(mixed, 5)).shape == (5, enc2.out_dim)
    assert calls == [5, 5]


def test_pool_encoder_features_depend_on_each_camera():
    enc = ObsEncoder(SMALL_SPEC, POOL)
    obs = obs_batch(SMALL_SPEC, 2)
    base = enc(obs)
    for key in SMALL_SPEC.image_keys:
        other = dict(obs)
        other[key] = torch.flip(obs[key], dims=[1])
        assert not torch.allclose(enc(other), base)


def test_spatial_embeddings_by_hand():
    se = SpatialLearnedEmbeddings(channels=2, height=2, width=2, num_features=3)
    x = torch.randn(4, 2, 2, 2)
    want = torch.einsum("bchw,chwf->bcf", x, se.kernel.view(2, 2, 2, 3)).reshape(4, 6)
    torch.testing.assert_close(se(x), want)


def test_unknown_image_encoder_is_refused():
    with pytest.raises(ValueError, match="image_encoder"):
        ObsEncoder(SMALL_SPEC, EncoderConfig(image_encoder="resnet"))


def shared_agent(spec=SMALL_SPEC, pcfg=POOL, **cfg) -> SACAgent:
    torch.manual_seed(0)
    policy = MLPPolicy(pcfg, spec)
    sac = SACConfig(**{"batch_size": 8, "critic_hidden_dims": (32, 32), "critic_encoder": "shared",
                       **cfg})
    return SACAgent(sac, policy, spec, Accelerator(cpu=True))


def test_shared_encoder_is_one_module_trained_by_the_critic_only():
    agent = shared_agent()
    assert agent.critic.encoder is agent.policy.encoder
    assert agent.target_critic.encoder is not agent.policy.encoder
    enc_ids = {id(p) for p in agent.policy.encoder.parameters()}
    actor_ids = {id(p) for g in agent.actor_opt.param_groups for p in g["params"]}
    critic_ids = {id(p) for g in agent.critic_opt.param_groups for p in g["params"]}
    assert enc_ids <= critic_ids and not enc_ids & actor_ids
    assert actor_ids  # the trunk and head


def test_shared_encoder_update_runs_each_backbone_once_per_observation():
    agent = shared_agent(utd_ratio=3)
    online, target = [], []
    agent.policy.encoder.pooled.backbone.register_forward_hook(lambda *a: online.append(1))
    agent.target_critic.encoder.pooled.backbone.register_forward_hook(lambda *a: target.append(1))
    batch = train_batch(SMALL_SPEC, 8)
    enc_before = [p.detach().clone() for p in agent.policy.encoder.parameters()]
    head_before = agent.policy.head.weight.detach().clone()
    m = agent.update(repeat(batch))
    # per critic step: obs (with gradient) and next obs (the policy's next action) through the
    # online backbone, next obs through the target's; the actor step reuses the features
    assert len(online) == 2 * 3 and len(target) == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert any(not torch.equal(a, b) for a, b in zip(enc_before, agent.policy.encoder.parameters()))
    assert not torch.equal(head_before, agent.policy.head.weight)


def test_own_encoder_update_runs_more_backbone_passes():
    """The default (critic and policy with their own encoders) as the baseline the shared
    mode improves on: the actor step encodes again through both."""
    torch.manual_seed(0)
    policy = MLPPolicy(POOL, SMALL_SPEC)
    agent = SACAgent(SACConfig(batch_size=8, critic_hidden_dims=(32, 32), utd_ratio=3,
                               critic_image_encoder="pool", critic_cnn_channels=(8, 8, 8)),
                     policy, SMALL_SPEC, Accelerator(cpu=True))
    calls = []
    for enc in (agent.policy.encoder, agent.critic.encoder, agent.target_critic.encoder):
        enc.pooled.backbone.register_forward_hook(lambda *a: calls.append(1))
    agent.update(repeat(train_batch(SMALL_SPEC, 8)))
    assert len(calls) == 3 * 3 + 2


def test_shared_encoder_state_dict_round_trip_and_state_only():
    agent = shared_agent()
    agent.update(repeat(train_batch(SMALL_SPEC, 8)))
    state = agent.state_dict()
    other = shared_agent()
    other.load_state_dict(state)
    obs = obs_batch(SMALL_SPEC, 4)
    a = agent.policy.act(obs, deterministic=True).actions
    torch.testing.assert_close(other.policy.act(obs, deterministic=True).actions, a)
    # state-only: the shared encoder is the identity on the state; the update still learns
    spec = EnvSpec(state_dim=5, action_dim=2, max_episode_steps=50)
    st = shared_agent(spec, MLPPolicyConfig(hidden_dims=(16,)))
    m = st.update(repeat(train_batch(spec, 8)))
    assert m["num_updates"] == 1.0


def test_shared_encoder_needs_a_policy_with_an_encoder():
    class Bare(torch.nn.Module):
        chunk_size = 1

    with pytest.raises(ValueError, match="critic_encoder=shared"):
        make_critic(SACConfig(critic_encoder="shared"), SMALL_SPEC, Bare())


def test_frozen_backbone_is_not_trained_and_runs_once_per_batch_for_online_and_target():
    pcfg = MLPPolicyConfig(**{**POOL.__dict__, "freeze_backbone": True, "backbone_cache": 0})
    agent = shared_agent(pcfg=pcfg, utd_ratio=2)
    calls = []
    for enc in (agent.policy.encoder, agent.target_critic.encoder):
        enc.pooled.backbone.register_forward_hook(lambda *a: calls.append(1))
    backbone = [p.detach().clone() for p in agent.policy.encoder.pooled.backbone.parameters()]
    pools = [p.detach().clone() for p in agent.policy.encoder.pooled.pools.parameters()]
    agent.update(repeat(train_batch(SMALL_SPEC, 8)))
    # per critic step: the obs once, the next obs once (the target reads the online pass)
    assert len(calls) == 2 * 2
    assert all(torch.equal(a, b) for a, b in zip(backbone, agent.policy.encoder.pooled.backbone.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(backbone, agent.target_critic.encoder.pooled.backbone.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(pools, agent.policy.encoder.pooled.pools.parameters()))
    # the memo answers only for the very same input tensors: a new batch is encoded afresh
    obs = obs_batch(SMALL_SPEC, 3)
    first = agent.policy.encoder(obs)
    other = {k: v.clone() for k, v in obs.items()}
    other["observation.images.front"] = torch.flip(obs["observation.images.front"], dims=[1])
    assert not torch.allclose(agent.policy.encoder(other), first)
    torch.testing.assert_close(agent.policy.encoder(obs), first)
    # the frozen backbone is in the state dict (actors get the same weights)
    assert any(k.startswith("encoder.pooled.backbone") for k in agent.policy.trainable_state_dict())


def test_frozen_backbone_cache_encodes_each_distinct_image_once_and_exactly():
    pcfg = MLPPolicyConfig(**{**POOL.__dict__, "freeze_backbone": True, "backbone_cache": 100})
    enc = ObsEncoder(SMALL_SPEC, pcfg)
    plain = ObsEncoder(SMALL_SPEC, MLPPolicyConfig(**{**pcfg.__dict__, "backbone_cache": 0}))
    plain.load_state_dict(enc.state_dict())
    seen = []
    enc.pooled.backbone.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    obs = obs_batch(SMALL_SPEC, 4)
    first = enc(obs)
    # the same images in new tensors (another replay batch): no backbone call, same features
    again = enc({k: v.clone() for k, v in obs.items()})
    assert seen == [8]
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(plain(obs), first)
    # two rows swapped with new images: only those two (per camera) are encoded
    mixed = {k: v.clone() for k, v in obs.items()}
    fresh = obs_batch(SMALL_SPEC, 2)
    for key in SMALL_SPEC.image_keys:
        mixed[key][:2] = fresh[key]
    torch.testing.assert_close(enc(mixed), plain(mixed))
    assert seen == [8, 4] and len(enc.pooled._cache) == 12


def test_state_embed_without_images_embeds_a_state_only_observation():
    """``state_embed_without_images``: linear + LayerNorm + tanh on the state also without
    cameras (LeRobot's gaussian_actor does); off (the default) the state goes in raw."""
    spec = EnvSpec(state_dim=4, action_dim=1, max_episode_steps=100)
    raw = ObsEncoder(spec, EncoderConfig(state_embed_dim=32))
    assert isinstance(raw.state, torch.nn.Identity) and raw.out_dim == 4
    enc = ObsEncoder(spec, EncoderConfig(state_embed_dim=32, state_embed_without_images=True))
    assert enc.out_dim == 32 and isinstance(enc.state[1], torch.nn.LayerNorm)
    out = enc({"observation.state": torch.randn(3, 4)})
    assert out.shape == (3, 32) and out.abs().max() <= 1.0
    # a shared-encoder SAC agent learns through it
    st = shared_agent(spec, MLPPolicyConfig(hidden_dims=(16,), state_embed_dim=16, state_embed_without_images=True))
    assert isinstance(st.policy.encoder.state[1], torch.nn.LayerNorm)
    assert st.update(repeat(train_batch(spec, 8)))["num_updates"] == 1.0
