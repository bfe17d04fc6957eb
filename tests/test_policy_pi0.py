"""PI0 / PI0.5 through lerobot: tiny random models in lerobot's checkpoint layout, built here."""

import json
import shutil

import numpy as np
import pytest
import torch

from agents.base import BCPolicy, NoiseConditionedPolicy, capabilities_of
from safetensors.torch import load_file, save_file

from agents import registry
from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
from agents.policies.vla_common import CheckpointMismatch, state_nbytes
from data.core.spec import EnvSpec
from data.core.weights import from_wire, to_wire
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (48, 48, 3), "wrist_image": (48, 48, 3)}, has_task=True)
CHUNK = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def policy(ckpt, cls=Pi0Policy, cfg_cls=Pi0PolicyConfig, **kw):
    kw.setdefault("lora_rank", 4)
    return cls(cfg_cls(checkpoint=str(ckpt), chunk_size=CHUNK, **kw), SPEC)


def obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = {"observation.state": torch.randn(b, 8, generator=g), "task": ["pick up the bowl", "open the drawer", "x"][:b]}
    for c in ("image", "wrist_image"):
        o[f"observation.images.{c}"] = torch.randint(0, 256, (b, 48, 48, 3), dtype=torch.uint8, generator=g)
    return o


def test_act_shapes_noise_seed_and_deterministic(ckpts):
    p = policy(ckpts["pi0"]).eval()
    assert capabilities_of(p) == {BCPolicy, NoiseConditionedPolicy} and p.chunk_size == CHUNK
    c = p.act(obs())
    assert c.actions.shape == (3, CHUNK, 7) and c.actions.dtype == torch.float32 and c.log_prob is None
    (dt, shape), = p.extras_spec().values()
    assert dt == "float32" and c.extras["noise"].shape == (3, *shape)
    torch.testing.assert_close(p.act(obs(), noise=c.extras["noise"]).actions, c.actions)
    assert c.actions.abs().max() <= 1.0
    torch.manual_seed(5)
    a1 = p.act(obs()).actions
    torch.manual_seed(5)
    assert torch.equal(a1, p.act(obs()).actions)
    d1, d2 = p.act(obs(), deterministic=True).actions, p.act(obs(), deterministic=True).actions
    assert torch.equal(d1, d2) and not torch.equal(d1, a1)
    # a batch row does not depend on the other rows (one forward serves many actors)
    row0 = {k: v[:1] for k, v in obs().items()}
    assert torch.allclose(p.act(row0, deterministic=True).actions[0], d1[0], atol=1e-5)


def test_bc_loss_decreases_on_a_fixed_batch(ckpts):
    p = policy(ckpts["pi0"]).train()
    batch = dict(obs(), action=torch.rand(3, CHUNK, 7) * 2 - 1)
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=2e-3)
    losses = []
    for _ in range(5):
        torch.manual_seed(0)  # same flow noise and time each step
        loss = p.bc_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and all(b < a for a, b in zip(losses, losses[1:])), losses
    # single-step actions ([B, A]) and padded steps are accepted
    assert torch.isfinite(p.bc_loss(dict(obs(), action=torch.zeros(3, 7))))
    pad = torch.zeros(3, CHUNK, dtype=torch.bool)
    pad[:, 4:] = True
    assert torch.isfinite(p.bc_loss(dict(obs(), action=torch.zeros(3, CHUNK, 7), action_is_pad=pad)))


def test_lora_snapshot_is_small_and_round_trips(ckpts):
    p = policy(ckpts["pi0"])
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-2)
    for _ in range(2):  # move the adapters away from their zero init
        loss = p.bc_loss(dict(obs(), action=torch.rand(3, CHUNK, 7)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    snap = p.trainable_state_dict()
    assert snap and all(".lora_" in k or k.split(".")[1] in ("action_in_proj", "action_out_proj", "state_proj",
                                                              "action_time_mlp_in", "action_time_mlp_out")
                        for k in snap)
    assert any(".gemma_expert." in k for k in snap) and any(".language_model." in k for k in snap)
    full = sum(t.numel() * t.element_size() for t in p.inner.state_dict().values())
    assert state_nbytes(snap) < 0.1 * full
    arrays, bf16 = to_wire(snap)  # the weight broadcast path
    fresh = policy(ckpts["pi0"]).eval()
    torch.manual_seed(1)
    before = fresh.act(obs()).actions
    fresh.load_trainable_state_dict(from_wire(arrays, bf16))
    p.eval()
    torch.manual_seed(1)
    want = p.act(obs()).actions
    torch.manual_seed(1)
    got = fresh.act(obs()).actions
    assert torch.equal(got, want) and not torch.equal(before, want)
    # serving folds the adapters into the weights: same actions as the live adapters, and
    # training afterwards sees the pristine base weights again
    live = policy(ckpts["pi0"], fold_lora_for_serving=False).eval()
    live.load_trainable_state_dict(snap)
    torch.manual_seed(1)
    assert torch.allclose(live.act(obs()).actions, want, atol=1e-5)
    w = "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj"
    assert fresh.lora.folded and type(fresh.inner.get_submodule(w)) is torch.nn.Linear  # no adapter code
    fresh.train()
    assert not fresh.lora.folded and hasattr(fresh.inner.get_submodule(w), "lora_A")
    base = load_file(str(ckpts["pi0"] / "model.safetensors"))[w + ".weight"]
    assert torch.equal(fresh.inner.get_submodule(w).base_layer.weight, base)
    with pytest.raises(ValueError, match="trainable state does not match this policy: missing"):
        policy(ckpts["pi0"], lora_scopes=("gemma_expert",)).load_trainable_state_dict(snap)
    with pytest.raises(ValueError, match=r"has shape \[4, 64\], policy has \[2, 64\]"):
        policy(ckpts["pi0"], lora_rank=2).load_trainable_state_dict(snap)


def test_pi05_acts_and_trains(ckpts):
    p = policy(ckpts["pi05"], Pi05Policy, Pi05PolicyConfig)
    prompt = p.tokenizer.decode(p.lerobot_batch(obs())["observation.language.tokens"][0], skip_special_tokens=True)
    assert prompt.startswith("Task: pick up the bowl, State: ") and "Action:" in prompt
    assert p.act(obs(2)).actions.shape == (2, CHUNK, 7)
    loss = p.bc_loss(dict(obs(), action=torch.zeros(3, CHUNK, 7)))
    loss.backward()
    assert torch.isfinite(loss) and any(".time_mlp_in." in k for k in p.trainable_state_dict())


def test_clear_errors_for_observations(ckpts):
    p = policy(ckpts["pi0"])
    o = obs()
    del o["observation.images.wrist_image"]
    with pytest.raises(ValueError, match=r"expected 2 camera image\(s\).*got 1"):
        p.act(o)
    o = obs()
    o["observation.images.image"] = torch.zeros(3, 32, 32, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'observation.images.image' must be uint8 \[B=3, 48, 48, 3\], got uint8 \[3, 32, 32, 3\]"):
        p.act(o)
    with pytest.raises(ValueError, match="missing instruction for batch row 1"):
        p.act(dict(obs(), task=["a", "", "b"]))
    o = obs()
    del o["task"]
    with pytest.raises(ValueError, match="missing instruction"):
        p.act(o)
    ok = policy(ckpts["pi0"], default_task="do it")
    o = obs()
    del o["task"]
    assert ok.act(o).actions.shape == (3, CHUNK, 7)
    three = EnvSpec(state_dim=8, action_dim=7, cameras={c: (48, 48, 3) for c in ("a", "b", "c")}, has_task=True)
    with pytest.raises(ValueError, match=r"the model expects 2 camera image\(s\).*env has 3"):
        Pi0Policy(Pi0PolicyConfig(checkpoint=str(ckpts["pi0"]), chunk_size=CHUNK), three)


def test_clear_errors_for_checkpoints(ckpts, tmp_path):
    with pytest.raises(CheckpointMismatch, match="is of type 'pi05', this policy loads 'pi0'"):
        policy(ckpts["pi05"])
    with pytest.raises(CheckpointMismatch, match="not a lerobot checkpoint folder"):
        policy(tmp_path)
    with pytest.raises(ValueError, match="checkpoint predicts chunks of 8 actions; set policy.chunk_size=8"):
        Pi0Policy(Pi0PolicyConfig(checkpoint=str(ckpts["pi0"]), chunk_size=50), SPEC)
    # sizes that do not match the tensors
    bad = tmp_path / "wider"
    shutil.copytree(ckpts["pi0"], bad)
    arch = json.loads((bad / "tandem_arch.json").read_text())
    (bad / "tandem_arch.json").write_text(json.dumps(dict(arch, width=96)))
    with pytest.raises(CheckpointMismatch, match=r"does not match the pi0 architecture.*shape mismatch"):
        policy(bad)
    # a tensor missing
    gone = tmp_path / "gone"
    shutil.copytree(ckpts["pi0"], gone)
    sd = load_file(str(gone / "model.safetensors"))
    key = next(k for k in sd if "action_out_proj.weight" in k)
    save_file({k: v for k, v in sd.items() if k != key}, str(gone / "model.safetensors"))
    with pytest.raises(CheckpointMismatch, match=r"1 missing tensor\(s\).*action_out_proj.weight"):
        policy(gone)


def test_registry_pairs_and_builds(ckpts):
    with pytest.raises(ValueError, match="'sac' cannot train policy 'pi0': the policy does not provide ReparamSampler"):
        registry.check_algo_policy("sac", "pi0")
    with pytest.raises(ValueError, match="'sac' cannot train policy 'pi05'"):
        registry.check_algo_policy("sac", "pi05")
    p = registry.build_policy({"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK,
                               "lora_rank": 2, "lora_scopes": ["gemma_expert"]}, SPEC)
    assert isinstance(p, Pi0Policy)
    assert not any(".language_model." in k for k in p.trainable_state_dict())
