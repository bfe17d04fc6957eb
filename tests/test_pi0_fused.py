"""Fused projections of PI0's fast serving path (agents/policies/pi0/fast_fused.py,
``policy.fast_fuse_proj``) and the autotuned compile (``policy.fast_autotune``).

On a CPU (float32 tiny models): stacking q/k/v and gate/up is the same arithmetic, so the
actions equal the plain fast path's and lerobot's to float32 round-off; the stand-ins are in
place only inside the fast path's calls (lerobot's modules and the training loss as they were);
new weights (folded and live adapters) are re-stacked into the same tensors, and nothing is
redone when nothing changed. On a GPU (skipped without CUDA): CUDA graphs over the compiled,
autotuned stages with the VLM and the expert fused equal lerobot's actions within the fast
path's bf16 tolerance, and new weights need no capture and no compile.
"""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0.fast_fused import FUSE_CHOICES, FusedAttention, FusedMLP, resolve_fuse
from agents.policies.pi0.policy import Pi0PolicyConfig
from agents.policies.vla_common import effective_weight
from test_pi0_fast import CHUNK, both, make, obs
from test_pi0_levers import assert_training_unchanged, noise_for, perturb

CPU_TOL = dict(atol=2e-5, rtol=1e-4)  # test_pi0_fast's CPU tolerance (float32 round-off)
GPU_TOL = dict(atol=5e-2, rtol=2e-2)  # its bf16 tolerance on a GPU


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from test_pi0_fast import SPEC
    from tools.make_tiny_checkpoints import make_pi0

    root = tmp_path_factory.mktemp("pi0fused")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def policy(ckpts, variant="pi0", seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("fast_serving", "eager")
    kw.setdefault("device", "cpu")
    return make(ckpts[variant], variant, **kw)


def lms(p):
    pwe = p.inner.model.paligemma_with_expert
    return pwe.gemma_expert.model, pwe.paligemma.model.language_model


def test_settings():
    from types import SimpleNamespace

    from agents.policies.pi0.fast_levers import lever_settings

    assert resolve_fuse("off") is None and resolve_fuse(False) is None
    assert resolve_fuse("expert") == "expert" and resolve_fuse("ALL") == "all"
    assert resolve_fuse("auto") is None and resolve_fuse("auto", cuda=True) == "all"
    assert FUSE_CHOICES == ("auto", "off", "expert", "all")
    cfg = Pi0PolicyConfig()
    assert cfg.fast_fuse_proj == "auto" and cfg.fast_autotune is False  # fused on a GPU; autotune off
    on_gpu = lever_settings(cfg, cuda=True)
    assert on_gpu["fuse"] == "all" and on_gpu["vision_dtype"] is torch.bfloat16 and not on_gpu["autotune"]
    off_gpu = lever_settings(cfg)
    assert off_gpu["fuse"] is None and off_gpu["vision_dtype"] is None
    # an explicit FP8 expert turns the automatic fusion off; an explicit fusion with FP8 is refused
    fp8 = lever_settings(SimpleNamespace(fast_vision_dtype="auto", fast_expert_fp8=True, fast_fuse_proj="auto",
                                         fast_autotune=False), cuda=True)
    assert fp8["fuse"] is None and fp8["expert_fp8"] == "cuda"
    with pytest.raises(ValueError, match="fast_fuse_proj"):
        Pi0PolicyConfig(fast_fuse_proj="vlm").validate()
    with pytest.raises(ValueError, match="fast_autotune"):
        Pi0PolicyConfig(fast_autotune="sometimes").validate()
    with pytest.raises(ValueError, match="fast_fuse_proj and policy.fast_expert_fp8"):
        Pi0PolicyConfig(fast_fuse_proj="expert", fast_expert_fp8="emulate").validate()
    import yaml

    for v in ("pi0", "pi05"):
        y = yaml.safe_load(open(f"config/policy/{v}.yaml"))
        assert y["fast_fuse_proj"] == "auto" and y["fast_autotune"] is False


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("fuse", ["expert", "all"])
def test_fused_actions_equal_the_plain_fast_path(ckpts, variant, fuse):
    p = policy(ckpts, variant, fast_fuse_proj=fuse)
    plain = policy(ckpts, variant)  # the same weights, nothing fused
    noise = noise_for(p)
    base, _ = both(plain, obs(), noise)
    fast, ref = both(p, obs(), noise)
    levers = p._fast.levers
    assert isinstance(levers.fused_expert.sites[0].stand_in, FusedAttention)
    assert isinstance(levers.fused_expert.sites[1].stand_in, FusedMLP)
    expert, vlm = lms(p)
    n = expert.config.num_hidden_layers
    assert len(levers.fused_expert.sites) == 2 * n
    assert (levers.fused_vlm is not None) == (fuse == "all")
    torch.testing.assert_close(fast, base, **CPU_TOL)
    torch.testing.assert_close(fast, ref, **CPU_TOL)
    # the stand-ins ran: a stand-in whose stacked weight is zeroed changes the actions
    site = levers.fused_expert.sites[0]
    w = site.stacked.weight.clone()
    site.stacked.weight.zero_()
    with torch.no_grad():
        broken = p.forward_model(p.model_inputs(obs()), noise)
    site.stacked.weight.copy_(w)
    assert float((broken - fast).abs().max()) > 1e-3
    # lerobot's modules are back in place after each call, and training does not see the lever
    for lm in (expert, vlm):
        assert type(lm.layers[0].self_attn).__name__ == "GemmaAttention"
        assert type(lm.layers[0].mlp).__name__ == "GemmaMLP"
    assert_training_unchanged(p, plain)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("vision_dtype", [None, torch.bfloat16])
def test_fused_vision_qkv(ckpts, variant, vision_dtype):
    """``FastPiSampler(fuse_vision=True)``: SigLIP's q/k/v as one GEMM per encoder layer, in the
    dtype SigLIP runs in (its own, or the bf16 copy's): the same actions as without (float32:
    to round-off; bf16: SigLIP's own rounding, the bf16 lever's tolerance); the stand-ins run in
    every encoder layer of each SigLIP pass and nowhere else; new vision weights are re-stacked."""
    from agents.policies.pi0.fast import FastPiSampler
    from agents.policies.pi0.fast_fused import FusedVisionAttention

    p = policy(ckpts, variant)
    noise = noise_for(p)
    model = p.inner.model
    p._fast = FastPiSampler(model, p.variant, graphs=False, compile=None, vision_dtype=vision_dtype)
    base, ref = both(p, obs(), noise)
    calls = []
    orig = FusedVisionAttention.forward

    def counted(self, *a, **kw):
        calls.append((a[0] if a else kw["hidden_states"]).shape[0])
        return orig(self, *a, **kw)

    FusedVisionAttention.forward = counted
    try:
        p._fast = FastPiSampler(model, p.variant, graphs=False, compile=None, vision_dtype=vision_dtype,
                                fuse_vision=True)
        out, _ = both(p, obs(), noise)
    finally:
        FusedVisionAttention.forward = orig
    layers = model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers
    assert len(calls) == len(layers) and set(calls) == {2 * 3}  # one pass of 2 cameras x 3 rows per layer
    assert p._fast.levers.fused_vision.sites[0].stacked.weight.dtype == (vision_dtype or torch.float32)
    tol = CPU_TOL if vision_dtype is None else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(out, base, **tol)
    torch.testing.assert_close(out, ref, **tol)
    assert type(layers[0].self_attn).__name__ == "SiglipAttention"  # lerobot's modules back after the call
    with torch.no_grad():  # new vision weights, written in place
        layers[0].self_attn.k_proj.weight.mul_(1.5)
        layers[0].self_attn.v_proj.bias.add_(0.3)
    before = p._fast.levers.fused_vision.restacked
    new, ref2 = both(p, obs(), noise)
    assert p._fast.levers.fused_vision.restacked > before
    torch.testing.assert_close(new, ref2, **tol)
    assert float((new - out).abs().max()) > 1e-4


@pytest.mark.parametrize("fold", [True, False])
def test_new_weights_are_restacked_in_place(ckpts, fold):
    """The learner's new LoRA weights reach the stacked tensors in place (what a CUDA graph
    reads), with folded and with live adapters; nothing is redone when nothing changed; the
    result equals a sampler built fresh on the new weights."""
    from agents.policies.pi0.fast import FastPiSampler

    p = policy(ckpts, fold_lora_for_serving=fold, lora_scopes=["language_model", "gemma_expert"],
               fast_fuse_proj="all")
    noise = noise_for(p)
    first, _ = both(p, obs(), noise)
    parts = [p._fast.levers.fused_expert, p._fast.levers.fused_vlm]
    ptrs = [s.stacked.weight.data_ptr() for f in parts for s in f.sites]
    counts = [f.restacked for f in parts]
    again, _ = both(p, obs(), noise)
    assert torch.equal(again, first) and [f.restacked for f in parts] == counts
    assert all(f.sync() == 0 for f in parts)
    perturb(p)
    new, ref = both(p, obs(), noise)
    assert all(f.restacked > c for f, c in zip(parts, counts))
    assert ptrs == [s.stacked.weight.data_ptr() for f in parts for s in f.sites]
    site = parts[0].sites[0]  # the stacked rows are the projections' effective weights
    want = torch.cat([effective_weight(m)[0] for m in site.live()]).to(site.stacked.weight.dtype)
    torch.testing.assert_close(site.stacked.weight, want, atol=0 if fold else 1e-6, rtol=0 if fold else 1e-6)
    assert float((new - first).abs().max()) > 0.1  # stale weights would be far off
    torch.testing.assert_close(new, ref, **CPU_TOL)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, fuse="all")
    fresh, _ = both(p, obs(), noise)
    torch.testing.assert_close(fresh, new, atol=1e-6, rtol=1e-6)


def test_fused_flow_rl_chain(ckpts):
    """The flow-RL act (fast_chain.py) runs its Euler steps through the fused expert."""
    from agents import registry
    from test_pi0_fast import SPEC

    cfg = {"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK, "lora_rank": 4, "device": "cpu",
           "fast_serving": "eager", "flow_rl": "noise", "num_inference_steps": 4, "fast_fuse_proj": "all"}
    torch.manual_seed(0)
    p = registry.build_policy(cfg, SPEC).eval()
    noise = noise_for(p)
    a = p.act(obs(), deterministic=True, noise=noise).actions
    assert p._fast.levers.fused_expert is not None
    p.cfg.fast_serving = "off"  # lerobot's modules, nothing fused
    ref = p.act(obs(), deterministic=True, noise=noise).actions
    torch.testing.assert_close(a, ref, **CPU_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_fused_autotuned_equal_lerobot_on_gpu(ckpts, variant):
    """CUDA graphs over compiled, autotuned stages, VLM and expert fused: lerobot's actions within
    the bf16 tolerance; new weights re-stack in place with no capture and no compile."""
    from agents.policies.fast_common import compiled_graphs

    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=True,
               fast_fuse_proj="all", fast_autotune=True, fast_vision_dtype="bf16")
    noise = noise_for(p, b=1)
    o = obs(1)
    fast, ref = both(p, o, noise)
    assert p._fast.autotune and p._fast.captures == 1
    torch.testing.assert_close(fast, ref, **GPU_TOL)
    compiled = compiled_graphs()
    ptr = p._fast.levers.fused_expert.sites[0].stacked.weight.data_ptr()
    perturb(p)
    fast2, ref2 = both(p, o, noise)
    assert p._fast.captures == 1 and compiled_graphs() == compiled
    assert p._fast.levers.fused_expert.sites[0].stacked.weight.data_ptr() == ptr
    torch.testing.assert_close(fast2, ref2, **GPU_TOL)
    assert not torch.allclose(fast2, fast, **GPU_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_fused_vision_on_gpu(ckpts, variant):
    """SigLIP's fused q/k/v (bf16 copies) with the GPU defaults, compiled under CUDA graphs:
    lerobot's actions within the bf16 tolerance; new vision weights re-stacked, no capture."""
    from agents.policies.pi0.fast import FastPiSampler

    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto")
    noise = noise_for(p)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=True, compile=True, vision_dtype=torch.bfloat16,
                            fuse="all", step_kv=True, fuse_vision=True)
    out, ref = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(out, ref, **GPU_TOL)
    layers = p.inner.model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers
    with torch.no_grad():
        layers[0].self_attn.k_proj.weight.mul_(1.5)
    new, ref2 = both(p, obs(), noise)
    assert p._fast.captures == 1 and p._fast.levers.fused_vision.restacked > 0
    torch.testing.assert_close(new, ref2, **GPU_TOL)
