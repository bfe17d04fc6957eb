"""``FastPiSampler(prefix_attention="cudnn")`` (agents/policies/pi0/fast.py): cuDNN first in SDPA's
backend order while SigLIP and the prefix pass run (and trace, where compiled). The order changes
which kernel computes the same attention, not what it computes: on a CPU (no cuDNN attention: the
usual order follows) the actions equal the default's to float32 round-off and SDPA's order is
back to torch's afterwards; a bad value is refused. On a GPU (skipped without CUDA), under CUDA
graphs and the compiled stages, lerobot's actions within the bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0.fast import FastPiSampler
from test_pi0_fast import both, obs
from test_pi0_fused import CPU_TOL, GPU_TOL, ckpts  # noqa: F401 - the module's checkpoints
from test_pi0_levers import noise_for
from test_pi0_step_kv import policy, sampler


def test_cudnn_first_equals_the_default_on_a_cpu(ckpts):  # noqa: F811
    """PI0 (PI0.5's prefix pass is the same code: the GPU test covers both)."""
    p = policy(ckpts, "pi0")
    noise = noise_for(p)
    p._fast = sampler(p)
    plain, ref = both(p, obs(), noise)
    seen = []
    p._fast = sampler(p, prefix_attention="cudnn")
    orig = p._fast._sdpa_order

    def order():
        seen.append(1)
        return orig()

    p._fast._sdpa_order = order
    b = torch.backends.cuda
    flags = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())
    out, _ = both(p, obs(), noise)
    assert len(seen) == 2  # SigLIP, then the prefix pass
    assert flags == (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
                     b.cudnn_sdp_enabled())  # torch's settings again outside
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    with pytest.raises(ValueError, match="prefix_attention"):
        sampler(p, prefix_attention="flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_cudnn_first_under_graphs_and_compile_on_gpu(ckpts, variant):  # noqa: F811
    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto")
    noise = noise_for(p)
    plain, ref = both(p, obs(), noise)
    levers = p._fast.levers
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=True, compile=True, prefix_attention="cudnn",
                            vision_dtype=levers.vision.dtype, fuse="all")
    out, _ = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(out, ref, **GPU_TOL)
    torch.testing.assert_close(out, plain, **GPU_TOL)
