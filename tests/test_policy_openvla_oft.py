"""OpenVLA-OFT without remote code: tiny checkpoints in the published layout, written here."""

import json
import shutil

import numpy as np
import pytest
import torch

from agents.base import BCPolicy, LogProbPolicy, capabilities_of
from safetensors.torch import load_file

from agents import registry
from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig
from agents.policies.vla_common import CheckpointMismatch, state_nbytes
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_openvla_oft

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (48, 48, 3), "wrist_image": (48, 48, 3)}, has_task=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft")
    return {f: make_openvla_oft(root / f, SPEC, head_format=f) for f in ("pt", "safetensors")}


def policy(ckpt, discrete=False, **kw):
    kw.setdefault("lora_rank", 4)
    if discrete:
        return OpenVLAOFTDiscretePolicy(OpenVLAOFTDiscretePolicyConfig(checkpoint=str(ckpt), **kw), SPEC)
    return OpenVLAOFTPolicy(OpenVLAOFTPolicyConfig(checkpoint=str(ckpt), **kw), SPEC)


def obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = {"observation.state": torch.randn(b, 8, generator=g), "task": ["Pick up the bowl", "open the drawer", "x"][:b]}
    for c in ("image", "wrist_image"):
        o[f"observation.images.{c}"] = torch.randint(0, 256, (b, 48, 48, 3), dtype=torch.uint8, generator=g)
    return o


def test_published_layout_loads_bit_exactly(ckpts):
    ck = ckpts["pt"]
    names = sorted(p.name for p in ck.iterdir())
    assert {"config.json", "model.safetensors", "dataset_statistics.json", "action_head--100_checkpoint.pt",
            "proprio_projector--100_checkpoint.pt", "tokenizer.json"} <= set(names)
    assert json.loads((ck / "config.json").read_text())["model_type"] == "openvla"
    p = policy(ck, lora_rank=0)
    want = load_file(str(ck / "model.safetensors"))
    got = p.model.state_dict()
    assert set(got) == set(want)
    assert "vision_backbone.featurizer.blocks.0.ls1.scale_factor" in got  # published LayerScale name
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("action_head", "proprio_projector"):
        sd = torch.load(ck / f"{name}--100_checkpoint.pt", weights_only=True)
        mine = getattr(p, name).state_dict()
        assert all(torch.equal(mine[k.removeprefix("module.")], v) for k, v in sd.items()) and len(sd) == len(mine)
    # the same weights with safetensors head files act identically
    q = policy(ckpts["safetensors"], lora_rank=0)
    assert torch.equal(p.act(obs()).actions, q.act(obs()).actions)


def test_l1_head_acts_and_trains(ckpts):
    p = policy(ckpts["pt"])
    assert capabilities_of(p) == {BCPolicy} and p.extras_spec() == {}
    a = p.act(obs()).actions
    assert a.shape == (3, 8, 7) and a.dtype == torch.float32 and a.abs().max() <= 1
    assert torch.equal(a, p.act(obs(), deterministic=True).actions)
    row0 = {k: v[:1] for k, v in obs().items()}  # rows are independent of each other (right padding)
    assert torch.allclose(p.act(row0).actions[0], a[0], atol=1e-5)
    p.train()
    batch = dict(obs(), action=torch.rand(3, 8, 7) * 2 - 1)
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=2e-3)
    losses = []
    for _ in range(4):
        loss = p.bc_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_discrete_head_sampling_and_log_probs(ckpts):
    p = policy(ckpts["pt"], discrete=True, temperature=0.7)
    assert {LogProbPolicy, BCPolicy} <= capabilities_of(p)
    assert p.extras_spec() == {"log_prob": ("float32", ()), "action_tokens": ("int64", (8 * 7,))}
    torch.manual_seed(0)
    c = p.act(obs())
    assert c.actions.shape == (3, 8, 7) and c.log_prob.shape == (3,) and torch.isfinite(c.log_prob).all()
    tok = c.extras["action_tokens"]
    assert tok.shape == (3, 56) and tok.min() >= 0 and tok.max() < 256
    assert torch.allclose(p.log_prob(obs(), c.actions, tokens=tok), c.log_prob, atol=1e-4)
    # OpenVLA's bins: every class but 0 (which only the value 1.0 reaches) decodes and re-encodes to itself
    cls = torch.arange(1, 256)
    vals = p.class_values[cls]
    assert torch.equal(torch.bucketize(vals, p.bins, right=True), 256 - cls)
    d = p.act(obs(), deterministic=True)
    logits = p.action_logits(p.action_hidden(obs()))
    assert torch.equal(d.extras["action_tokens"], logits.argmax(-1))
    # the greedy chunk's log-prob is reported too (every act carries its declared extras)
    assert torch.allclose(p.log_prob(obs(), d.actions, tokens=d.extras["action_tokens"]), d.log_prob,
                          atol=1e-4)
    # lower temperature: the argmax chunk gets more likely
    cold = policy(ckpts["pt"], discrete=True, temperature=0.1)
    best = d.extras["action_tokens"]
    assert (cold.log_prob(obs(), None, tokens=best) > p.log_prob(obs(), None, tokens=best)).all()
    p.train()
    batch = dict(obs(), action=d.actions)
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=5e-3)
    losses = []
    for _ in range(3):
        loss = p.bc_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_lora_snapshot_round_trips(ckpts):
    p = policy(ckpts["pt"])
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = p.bc_loss(dict(obs(), action=torch.rand(3, 8, 7)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    snap = p.trainable_state_dict()
    assert all(".lora_" in k or k.startswith(("action_head.", "proprio_projector.")) for k in snap)
    assert any(".lora_" in k for k in snap)
    full = sum(t.numel() * t.element_size() for t in p.state_dict().values())
    assert state_nbytes(snap) < 0.25 * full
    fresh = policy(ckpts["pt"]).eval()
    before = fresh.act(obs()).actions
    fresh.load_trainable_state_dict(snap)
    want = p.eval().act(obs()).actions
    assert torch.equal(fresh.act(obs()).actions, want) and not torch.equal(before, want)


def test_clear_errors(ckpts, tmp_path):
    p = policy(ckpts["pt"])
    o = obs()
    del o["observation.images.image"]
    with pytest.raises(ValueError, match=r"expected 2 camera image\(s\)"):
        p.act(o)
    o = obs()
    o["observation.images.wrist_image"] = torch.zeros(3, 48, 40, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'observation.images.wrist_image' must be uint8"):
        p.act(o)
    with pytest.raises(ValueError, match="missing instruction for batch row 2"):
        p.act(dict(obs(), task=["a", "b", " "]))
    # heads made for another action size
    other = EnvSpec(state_dim=8, action_dim=6, cameras=SPEC.cameras, has_task=True)
    with pytest.raises(CheckpointMismatch, match=r"action_head--100_checkpoint.pt.*does not match.*shape mismatch"):
        OpenVLAOFTPolicy(OpenVLAOFTPolicyConfig(checkpoint=str(ckpts["pt"])), other)
    # missing head file, wrong config, missing weights
    bad = tmp_path / "nohead"
    shutil.copytree(ckpts["pt"], bad)
    (bad / "action_head--100_checkpoint.pt").unlink()
    with pytest.raises(CheckpointMismatch, match="has no action_head--"):
        policy(bad)
    assert policy(bad, discrete=True).act(obs()).actions.shape == (3, 8, 7)  # the token head needs none
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="llava")))
    with pytest.raises(CheckpointMismatch, match="is not an OpenVLA config"):
        policy(bad, discrete=True)
    (bad / "config.json").write_text(json.dumps(dict(cfg, text_config=dict(cfg["text_config"], hidden_size=96))))
    with pytest.raises(CheckpointMismatch, match=r"does not match the OpenVLA architecture.*shape mismatch"):
        policy(bad, discrete=True)
    with pytest.raises(ValueError, match="cannot train policy 'openvla_oft': the policy does not provide ReparamSampler"):
        registry.check_algo_policy("sac", "openvla_oft")
    with pytest.raises(ValueError, match=r"use policy=openvla_oft_discrete"):
        OpenVLAOFTPolicy(OpenVLAOFTPolicyConfig(checkpoint=str(ckpts["pt"]), action_head="discrete"), SPEC)
