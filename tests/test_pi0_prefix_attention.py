"""``FastPiSampler(prefix_attention="cudnn")`` (agents/policies/pi0/fast.py, fast_attention.py):
the prefix pass's attention, and SigLIP's in passes of ``CUDNN_MIN_IMAGES`` images or more, run
:func:`cudnn_attention` (cuDNN's fused attention as its own op, so the kernel is part of the
traced graph). On a CPU it falls back to SDPA: the attention interface is taken by the right
layers (a spy counts calls; the function itself runs), SigLIP's setting is restored after, small
passes keep SDPA, and the actions equal the default's to float32 round-off; a bad value is
refused. On a GPU (skipped without CUDA), under CUDA graphs and the compiled stages: lerobot's
actions within the bf16 tolerance, and cuDNN's kernels in the profile of the compiled path."""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0 import fast_attention
from agents.policies.pi0.fast import CUDNN_MIN_IMAGES, FastPiSampler
from test_pi0_fast import both, obs
from test_pi0_fused import CPU_TOL, GPU_TOL, ckpts  # noqa: F401 - the module's checkpoints
from test_pi0_levers import noise_for
from test_pi0_step_kv import policy, sampler


@pytest.fixture
def calls(monkeypatch):
    """Which attention modules ran :func:`cudnn_attention` (by class name); the function runs."""
    from transformers import AttentionInterface

    seen = []
    real = fast_attention.cudnn_attention

    def spy(module, *args, **kwargs):
        seen.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, fast_attention.CUDNN_NAME, spy)  # noqa: SLF001
    return seen


def test_cudnn_attention_equals_the_default_on_a_cpu(ckpts, calls):  # noqa: F811
    """PI0 (PI0.5's prefix pass is the same code: the GPU test covers both)."""
    p = policy(ckpts, "pi0")
    noise = noise_for(p)
    p._fast = sampler(p)
    plain, ref = both(p, obs(), noise)
    assert calls == []
    p._fast = sampler(p, prefix_attention="cudnn")
    vision = p._fast._vision_cfgs
    assert vision and {c._attn_implementation for c in vision} != {fast_attention.CUDNN_NAME}
    before = [c._attn_implementation for c in vision]
    out, _ = both(p, obs(), noise)  # 3 observations x 2 cameras: one SigLIP pass of 6 images
    assert 6 >= CUDNN_MIN_IMAGES
    vlm_layers = p._fast.vlm.config.num_hidden_layers
    assert calls.count("SiglipAttention") == p.inner.model.paligemma_with_expert.paligemma.config.vision_config \
        .num_hidden_layers
    assert len(calls) - calls.count("SiglipAttention") == vlm_layers  # the prefix pass's layers, no step
    assert [c._attn_implementation for c in vision] == before  # SigLIP's setting restored
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    calls.clear()
    both(p, obs(b=1), noise[:1])  # 2 images: SigLIP keeps SDPA, the prefix pass takes cuDNN's
    assert "SiglipAttention" not in calls and len(calls) == vlm_layers
    with pytest.raises(ValueError, match="prefix_attention"):
        sampler(p, prefix_attention="flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_cudnn_attention_under_graphs_and_compile_on_gpu(ckpts, variant):  # noqa: F811
    from torch.profiler import ProfilerActivity, profile

    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto")
    noise = noise_for(p)
    plain, ref = both(p, obs(), noise)
    levers = p._fast.levers
    kw = dict(compile=True, prefix_attention="cudnn", vision_dtype=levers.vision.dtype, fuse="all", step_kv=True)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=True, **kw)
    out, _ = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(out, ref, **GPU_TOL)
    torch.testing.assert_close(out, plain, **GPU_TOL)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, **kw)  # the compiled path, kernels visible
    both(p, obs(), noise)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        again, _ = both(p, obs(), noise)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert any("cudnn" in n.lower() for n in names), sorted(names)[:40]
    torch.testing.assert_close(again, ref, **GPU_TOL)
