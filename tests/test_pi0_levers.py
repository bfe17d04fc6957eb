"""The precision levers of PI0's fast serving path (agents/policies/pi0/fast_levers.py):
``policy.fast_vision_dtype=bf16`` (SigLIP + projector from a bf16 copy) and
``policy.fast_expert_fp8`` (the expert's step linears in FP8 e4m3).

On a CPU: the quantization arithmetic (through the emulated product), the config plumbing,
re-quantization in place when new weights arrive (folded and live adapters), that the levers
leave lerobot's modules and the training path as they were, and that with both off nothing of
them runs. On a GPU (skipped without CUDA): ``torch._scaled_mm`` equals the emulation, and the
served actions (CUDA graphs, eager and compiled stages) equal lerobot's within the tolerances
below.

Tolerances (max |fast - lerobot| over the actions, normalised space, tiny random models whose
actions reach |a| ~ 4): bf16 SigLIP alone stays within the fast path's bf16 tolerance
(measured on a CPU, 6 seeds: <= 0.024); FP8 (e4m3 keeps 3 mantissa bits: <= 6% error per
element) moved PI0's actions by 0.055-0.12 and PI0.5's by 0.008-0.019 on the same 6 seeds, so
the checks allow 0.2 (PI0) and 0.04 (PI0.5): about twice the largest seen, far below what
stale weights move them (~2.5, checked below)."""

from __future__ import annotations

import pytest
import torch

from agents.policies.fp8 import (AMAX_EPS, E4M3, E4M3_MAX, Fp8Linear, check_fp8, dequantize, fp8_unavailable,
                                 quantize_rows)
from agents.policies.pi0.fast_levers import resolve_expert_fp8, resolve_vision_dtype
from agents.policies.vla_common import effective_weight
from agents.policies.pi0.policy import Pi0PolicyConfig
from test_pi0_fast import CHUNK, SPEC, both, make, obs
from tools.make_tiny_checkpoints import TINY_PI0_ARCH, make_pi0

#: max |fast - lerobot| with FP8 on (module docstring)
FP8_TOL = {"pi0": 0.2, "pi05": 0.04}
VISION_TOL = 0.05
LEVERS = {"vision": {"fast_vision_dtype": "bf16"}, "fp8": {"fast_expert_fp8": "emulate"},
          "both": {"fast_vision_dtype": "bf16", "fast_expert_fp8": "emulate"}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny PI0 / PI0.5 with head_dim 16: every expert linear has dims that are multiples of 16
    (what torch._scaled_mm needs), so on a GPU all of them run in FP8."""
    root = tmp_path_factory.mktemp("pi0levers")
    arch = dict(TINY_PI0_ARCH, head_dim=16)
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK, arch=arch) for v in ("pi0", "pi05")}


def policy(ckpts, variant="pi0", seed=0, **kw):
    torch.manual_seed(seed)  # LoRA's A is drawn from the global RNG
    kw.setdefault("fast_serving", "eager")
    kw.setdefault("device", "cpu")
    return make(ckpts[variant], variant, **kw)


def noise_for(p, b=3, seed=2):
    d = int(p.lr_cfg.max_action_dim)
    return torch.randn(b, CHUNK, d, generator=torch.Generator().manual_seed(seed)).to(p.device)


def perturb(p, seed=3, scale=0.05):
    """New trainable weights, as the learner pushes them (LoRA + heads), then back to serving."""
    g = torch.Generator().manual_seed(seed)
    p.load_trainable_state_dict({k: v + scale * torch.randn(v.shape, generator=g).to(v)
                                 for k, v in p.trainable_state_dict().items()})
    p.eval()


# -- the arithmetic --------------------------------------------------------------------------------
def test_quantize_rows_maps_each_rows_amax_to_448_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0, 1.0])[:, None]
    x[5] = 0.0  # an all-zero row: zeros, no NaN
    x[2, 7] = 50.0  # an outlier sets its row's scale
    q, s = quantize_rows(x)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (6, 1)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s, amax.clamp_min(AMAX_EPS) / E4M3_MAX, rtol=0, atol=0)
    qf = q.float()
    assert torch.isfinite(qf).all() and qf.abs().max() <= E4M3_MAX
    assert torch.equal(qf.abs().amax(-1)[:5], torch.full((5,), E4M3_MAX))  # each row's largest -> +-448
    assert torch.equal(qf[5], torch.zeros(64))
    # e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; subnormals (below
    # 2^-6) within half their spacing, 2^-10
    err = (x / s - qf).abs()
    assert (err <= torch.maximum((x / s).abs() * 2 ** -4, torch.tensor(2 ** -10)) + 1e-6).all()
    torch.testing.assert_close(dequantize(q, s), qf * s)
    assert (dequantize(q, s) - x).abs().max() > 0  # it does round


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_emulation_is_the_scaled_product_of_the_quantized_operands(bias):
    """y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] (+ bias), what torch._scaled_mm computes
    with row-wise scales; and it is the float product to within FP8's error."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * torch.linspace(0.1, 3.0, 48)[:, None]  # per-channel scales differ
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(2, 51, 64, generator=g)  # [B, rows, K]: 51 rows, as a denoising step of PI0
    lin = Fp8Linear(48, 64, torch.device("cpu"), torch.float32, emulate=True, bias=bias)
    lin.load(w, b)
    wq, ws = quantize_rows(w)
    assert torch.equal(lin.qweight.float(), wq.float()) and torch.equal(lin.wscale, ws.view(1, -1))
    assert lin.weight.dtype == torch.float32 and lin.weight.numel() == 0  # a dtype marker only
    y = lin(x)
    assert y.shape == (2, 51, 48)
    xq, xs = quantize_rows(x.reshape(-1, 64))
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double().view(1, -1)
    if bias:
        exact = exact + b.double()
    torch.testing.assert_close(y.reshape(-1, 48).double(), exact, rtol=1e-6, atol=1e-5)
    ref = x @ w.t() + (b if bias else 0)
    rel = (y - ref).norm() / ref.norm()
    assert 1e-3 < rel < 0.06, rel  # FP8's error: present, and a few percent


def test_effective_weight_of_live_adapters_is_the_folded_weight(ckpts):
    """The weight FP8 quantizes: base + scale * B @ A of a live peft wrapper equals what
    LoRAServing folds into the base Linear."""
    p = policy(ckpts)
    p.lora.unfold()
    expert = p.inner.model.paligemma_with_expert.gemma_expert.model
    live = expert.layers[0].self_attn.q_proj
    assert hasattr(live, "lora_A")
    w_live, _, srcs = effective_weight(live)
    assert len(srcs) == 3  # base, A, B
    p.lora.fold()
    folded = expert.layers[0].self_attn.q_proj
    assert isinstance(folded, torch.nn.Linear) and folded is live.base_layer
    w_folded, _, srcs = effective_weight(folded)
    assert len(srcs) == 1
    torch.testing.assert_close(w_live, w_folded, rtol=0, atol=1e-6)
    assert (w_folded - folded.weight.float()).abs().max() == 0


# -- config ------------------------------------------------------------------------------------------
def test_lever_settings_and_their_config():
    import yaml

    assert resolve_vision_dtype("fp32") is None and resolve_vision_dtype("bf16") is torch.bfloat16
    assert resolve_vision_dtype("bfloat16") is torch.bfloat16
    assert resolve_expert_fp8(False) is None and resolve_expert_fp8("false") is None
    assert resolve_expert_fp8(True) == "cuda" and resolve_expert_fp8("emulate") == "emulate"
    assert resolve_vision_dtype("auto") is None and resolve_vision_dtype("auto", cuda=True) is torch.bfloat16
    cfg = Pi0PolicyConfig()
    # bf16 SigLIP where the fast path runs on a GPU, fp32 elsewhere; FP8 off
    assert cfg.fast_vision_dtype == "auto" and cfg.fast_expert_fp8 is False
    for name in ("pi0", "pi05"):  # the shipped configs say the same
        y = yaml.safe_load(open(f"config/policy/{name}.yaml"))
        assert y["fast_vision_dtype"] == "auto" and y["fast_expert_fp8"] is False
    with pytest.raises(ValueError, match="fast_vision_dtype"):
        Pi0PolicyConfig(fast_vision_dtype="fp16").validate()
    with pytest.raises(ValueError, match="fast_expert_fp8"):
        Pi0PolicyConfig(fast_expert_fp8="fp4").validate()


def test_fp8_on_a_device_without_fp8_gemms_fails_at_build(ckpts):
    """true on a CPU: the policy is not built, and the error says why and what to set."""
    assert "cpu" in fp8_unavailable("cpu")
    with pytest.raises(RuntimeError, match="fast_expert_fp8=true.*cpu"):
        check_fp8("cpu")
    with pytest.raises(RuntimeError, match="fast_expert_fp8=false"):
        policy(ckpts, fast_expert_fp8=True)


def test_the_policy_hands_the_levers_to_its_fast_path(ckpts):
    p = policy(ckpts, fast_vision_dtype="bf16", fast_expert_fp8="emulate")
    with torch.no_grad():
        fast = p._fast_sampler()
    assert fast.levers.vision.dtype is torch.bfloat16 and fast.levers.fp8.mode == "emulate"
    assert len(fast.levers.fp8.sites) == 2 * 7 and not fast.levers.fp8.skipped
    from agents import registry  # the registry's config path takes the keys too

    cfg = {"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK, "lora_rank": 4, "device": "cpu",
           "fast_serving": "eager", "fast_vision_dtype": "bf16", "fast_expert_fp8": "emulate"}
    q = registry.build_policy(cfg, SPEC).eval()
    with torch.no_grad():
        assert q._fast_sampler().levers.fp8 is not None


# -- the serving path on a CPU -------------------------------------------------------------------------
def test_levers_off_run_nothing_of_them(ckpts):
    """Both off (the default): the sampler holds no levers, and its actions are bit for bit
    those of a sampler built without the new arguments (today's construction)."""
    from agents.policies.pi0.fast import FastPiSampler

    p = policy(ckpts)
    noise = noise_for(p)
    fast, ref = both(p, obs(), noise)
    assert p._fast.levers is None
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None)
    again, _ = both(p, obs(), noise)
    assert torch.equal(fast, again)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-4)  # test_pi0_fast's CPU tolerance


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("lever", list(LEVERS))
def test_levers_stay_close_to_lerobot_and_leave_its_modules_alone(ckpts, variant, lever):
    p = policy(ckpts, variant, **LEVERS[lever])
    pm = p.inner.model.paligemma_with_expert.paligemma.model
    vision_before = list(pm.vision_tower.parameters())
    expert = p.inner.model.paligemma_with_expert.gemma_expert.model
    noise = noise_for(p)
    plain = policy(ckpts, variant)  # the same weights (same seed), no levers
    base, _ = both(plain, obs(), noise)
    fast, ref = both(p, obs(), noise)
    diff = float((fast - ref).abs().max())
    tol = FP8_TOL[variant] if "fast_expert_fp8" in LEVERS[lever] else VISION_TOL
    assert 1e-5 < diff < tol, diff  # changed (the lever ran), within the tolerance
    torch.testing.assert_close(base, ref, atol=2e-5, rtol=1e-4)
    # lerobot's modules are as they were: float32 SigLIP (the same tensors), the expert's Linears
    after = list(pm.vision_tower.parameters())
    assert len(after) == len(vision_before) and all(a is b for a, b in zip(after, vision_before))
    assert all(v.dtype == torch.float32 for v in after)
    assert type(expert.layers[0].mlp.down_proj).__name__ == "Linear"
    assert_training_unchanged(p, plain)


def assert_training_unchanged(p, plain):
    """The training path does not see the levers: the same BC loss as ``plain`` (no levers)."""
    batch = dict(obs(), action=torch.rand(3, CHUNK, SPEC.action_dim) * 2 - 1)
    p.train(), plain.train()
    torch.manual_seed(7)
    loss = p.bc_loss(batch)
    torch.manual_seed(7)
    assert torch.equal(loss, plain.bc_loss(batch))


@pytest.mark.parametrize("fold", [True, False])
def test_new_weights_are_requantized_in_place(ckpts, fold):
    """The learner's new LoRA weights reach the FP8 buffers and the bf16 copies in place (the
    tensors a CUDA graph reads), with folded adapters and with live ones; nothing is redone
    when nothing changed; the result is that of a sampler built fresh on the new weights."""
    from agents.policies.pi0.fast import FastPiSampler

    p = policy(ckpts, fold_lora_for_serving=fold, lora_scopes=["language_model", "gemma_expert", "vision"],
               **LEVERS["both"])
    noise = noise_for(p)
    first, _ = both(p, obs(), noise)
    fp8, vision = p._fast.levers.fp8, p._fast.levers.vision
    ptrs = [s.fp8.qweight.data_ptr() for s in fp8.sites] + [c.data_ptr() for _, c, _ in vision.copies.values()]
    q0 = fp8.sites[0].fp8.qweight.float().clone()
    n_fp8, n_vision = fp8.requantized, vision.refreshed
    again, _ = both(p, obs(), noise)
    assert torch.equal(again, first) and fp8.requantized == n_fp8 and vision.refreshed == n_vision
    assert fp8.sync() == 0 and vision.sync() == 0
    perturb(p)
    new, ref = both(p, obs(), noise)
    assert fp8.requantized - n_fp8 == len(fp8.sites)  # every expert linear has an adapter
    assert vision.refreshed > n_vision  # SigLIP's adapters (and folded weights) changed
    assert ptrs == [s.fp8.qweight.data_ptr() for s in fp8.sites] + [c.data_ptr() for _, c, _ in
                                                                     vision.copies.values()]
    site = fp8.sites[0]
    w, _, _ = effective_weight(site.parent._modules[site.attr])
    assert torch.equal(site.fp8.qweight.float(), quantize_rows(w)[0].float())
    assert not torch.equal(site.fp8.qweight.float(), q0)
    assert float((new - first).abs().max()) > 3 * FP8_TOL["pi0"]  # stale weights would be far off
    assert float((new - ref).abs().max()) < FP8_TOL["pi0"]
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None,
                            vision_dtype=torch.bfloat16, expert_fp8="emulate")
    fresh, _ = both(p, obs(), noise)
    assert torch.equal(fresh, new)


def test_flow_rl_chain_takes_the_levers(ckpts):
    """The flow-RL act (fast_chain.py) runs its Euler steps through the FP8 expert, re-quantized
    after new weights as plain sampling is."""
    from agents import registry

    cfg = {"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK, "lora_rank": 4, "device": "cpu",
           "fast_serving": "eager", "flow_rl": "noise", "num_inference_steps": 4, **LEVERS["fp8"]}
    torch.manual_seed(0)
    p = registry.build_policy(cfg, SPEC).eval()
    noise = noise_for(p)
    a = p.act(obs(), deterministic=True, noise=noise).actions
    fp8 = p._fast.levers.fp8
    n = fp8.requantized
    perturb(p)
    b = p.act(obs(), deterministic=True, noise=noise).actions
    assert fp8.requantized - n == len(fp8.sites) and not torch.allclose(a, b, atol=1e-2)
    p.cfg.fast_serving = "off"  # lerobot's modules, no levers
    ref = p.act(obs(), deterministic=True, noise=noise).actions
    assert 1e-5 < float((b - ref).abs().max()) < FP8_TOL["pi0"]


# -- GPU -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_scaled_mm_equals_the_emulation_on_gpu():
    """torch._scaled_mm with the layouts and row-wise scales Fp8Linear passes computes what the
    emulation computes (bf16 out: to its rounding), for 51-row and 3-D inputs."""
    if fp8_unavailable("cuda"):
        pytest.skip(fp8_unavailable("cuda"))
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    for n, k in ((256, 1024), (1024, 4096), (2048, 1024)):
        w = (torch.randn(n, k, generator=g) * 0.02).to(dev, torch.bfloat16)
        real = Fp8Linear(n, k, dev, torch.bfloat16, emulate=False)
        emu = Fp8Linear(n, k, dev, torch.bfloat16, emulate=True)
        real.load(w.float(), None)
        emu.load(w.float(), None)
        for shape in ((51, k), (2, 51, k), (1, 1, k)):
            x = torch.randn(*shape, generator=g).to(dev, torch.bfloat16)
            y, ye = real(x), emu(x)
            assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], n)
            torch.testing.assert_close(y.float(), ye.float(), rtol=1.6e-2, atol=1e-3)
            rel = (y.float() - (x.float() @ w.float().t())).norm() / (x.float() @ w.float().t()).norm()
            assert rel < 0.06


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_levers_equal_lerobot_on_gpu(ckpts, variant):
    """CUDA graphs (no compile) with bf16 SigLIP and the FP8 expert: lerobot's actions within
    the FP8 tolerance; new weights re-quantize into the buffers the graph reads (no capture)."""
    if fp8_unavailable("cuda"):
        pytest.skip(fp8_unavailable("cuda"))
    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=False,
               fast_vision_dtype="bf16", fast_expert_fp8=True)
    noise = noise_for(p)
    fast, ref = both(p, obs(), noise)
    fp8 = p._fast.levers.fp8
    assert p._fast.captures == 1 and fp8.mode == "cuda" and not fp8.skipped and len(fp8.sites) == 14
    torch.testing.assert_close(fast, ref, atol=FP8_TOL[variant], rtol=3e-2)
    ptr = fp8.sites[0].fp8.qweight.data_ptr()
    perturb(p)
    fast2, ref2 = both(p, obs(), noise)
    assert p._fast.captures == 1 and fp8.sites[0].fp8.qweight.data_ptr() == ptr
    torch.testing.assert_close(fast2, ref2, atol=FP8_TOL[variant], rtol=3e-2)
    assert not torch.allclose(fast2, fast, atol=FP8_TOL[variant])
    graphs = p._fast
    p.cfg.fast_serving, p._fast = "eager", None  # the same levers without a graph
    with torch.no_grad():
        plain = p.forward_model(p.model_inputs(obs()), noise)
    torch.testing.assert_close(fast2, plain, atol=5e-2, rtol=2e-2)  # 4 padded rows vs 3: FP8 may round apart
    p._fast = graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_levers_compile_on_gpu(ckpts):
    """torch.compile'd stages (the default on a GPU) trace the stand-ins: one capture, no
    recompile on new weights, lerobot's actions within the FP8 tolerance."""
    if fp8_unavailable("cuda"):
        pytest.skip(fp8_unavailable("cuda"))
    from agents.policies.fast_common import compiled_graphs

    p = policy(ckpts, "pi0", device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=True,
               fast_vision_dtype="bf16", fast_expert_fp8=True)
    noise = noise_for(p, b=1)
    o = obs(1)
    fast, ref = both(p, o, noise)
    torch.testing.assert_close(fast, ref, atol=FP8_TOL["pi0"], rtol=3e-2)
    compiled = compiled_graphs()
    perturb(p)
    fast2, ref2 = both(p, o, noise)
    assert p._fast.captures == 1 and compiled_graphs() == compiled
    torch.testing.assert_close(fast2, ref2, atol=FP8_TOL["pi0"], rtol=3e-2)
