"""The denoising steps' attention in Triton kernels (agents/policies/pi0/fast_triton.py,
``FastPiSampler(step_attention="triton")``). On a CPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported: a subprocess): they equal
``mqa_attention`` to float32 round-off on PI0's shapes and on grouped heads, with and without a
mask, reading the query in the layer's own layout; PI0's actions with them and the step buffers
equal the default path's and lerobot's (one case: the interpreter is slow; the GPU test covers
PI0.5), the kernels called for the denoising steps only. Without the interpreter a CPU falls back to ``mqa_attention``. The GPU
test (compiled, under CUDA graphs) is in tests/test_pi0_step_kv.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tandem_testutil import python_code

pytest.importorskip("triton")


def kernel_checks() -> None:
    """Run under the interpreter: the kernel against mqa_attention on random inputs."""
    from agents.policies.pi0.fast_attention import _additive, mqa_attention
    from agents.policies.pi0.fast_triton import triton_step_attention

    g = torch.Generator().manual_seed(0)
    for b, h, hkv, q, k, d in [(2, 8, 1, 7, 37, 8), (1, 8, 1, 51, 72, 32), (3, 4, 2, 5, 20, 16)]:
        query = torch.randn(b, q, h, d, generator=g).transpose(1, 2)  # [B, H, Q, D] as the layer holds it
        key, value = torch.randn(b, hkv, k, d, generator=g), torch.randn(b, hkv, k, d, generator=g)
        seen = torch.rand(b, q, k, generator=g) > 0.3
        seen[..., 0] = True
        for mask in (_additive(seen, torch.float32), None):
            out, _ = triton_step_attention(None, query, key, value, mask)
            ref, _ = mqa_attention(None, query, key, value, mask)
            assert out.shape == (b, q, h, d)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
        scaled, _ = triton_step_attention(None, query, key, value, None, scaling=0.5)
        assert float((scaled - out).abs().max()) > 1e-3  # the scale is used
    print("kernel ok")


def sampler_checks(root: str) -> None:
    """Run under the interpreter: the fast path's actions with the kernel for the steps."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_pi0_fast import CHUNK, SPEC, both, make, obs
    from test_pi0_fused import CPU_TOL
    from test_pi0_levers import noise_for
    from transformers import AttentionInterface

    from agents.policies.pi0 import fast_triton
    from agents.policies.pi0.fast import FastPiSampler
    from tools.make_tiny_checkpoints import make_pi0

    torch.manual_seed(0)
    p = make(make_pi0(Path(root) / "pi0", SPEC, variant="pi0", chunk_size=CHUNK), "pi0", fast_serving="eager",
             device="cpu")
    noise = noise_for(p)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None)
    plain, ref = both(p, obs(), noise)
    calls = []

    def counted(*a, **kw):
        calls.append(a[1].shape[2])
        return fast_triton.triton_step_attention(*a, **kw)

    AttentionInterface._global_mapping[fast_triton.TRITON_NAME] = counted  # noqa: SLF001
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, step_kv=True,
                            step_attention="triton")
    out, _ = both(p, obs(), noise)
    AttentionInterface._global_mapping[fast_triton.TRITON_NAME] = fast_triton.triton_step_attention  # noqa: SLF001
    layers = p.inner.model.paligemma_with_expert.gemma_expert.model.config.num_hidden_layers
    assert len(calls) == layers * int(p.lr_cfg.num_inference_steps)  # the steps only
    assert set(calls) == {CHUNK + 1}  # PI0's suffix: the state token and the chunk
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    print("sampler ok")


def test_kernel_equals_mqa_attention_under_the_interpreter():
    assert "kernel ok" in python_code("import test_pi0_triton_attention as t; t.kernel_checks()", timeout=600)


def test_actions_with_the_kernel_equal_the_default_path(tmp_path):
    out = python_code(f"import test_pi0_triton_attention as t; t.sampler_checks({str(tmp_path)!r})", timeout=600)
    assert "sampler ok" in out


def test_a_cpu_without_the_interpreter_falls_back():
    from agents.policies.pi0 import fast_attention, fast_triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on a CPU")
    assert not fast_triton.available("cpu")
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 1, 5, 8)
    out, _ = fast_triton.triton_step_attention(None, query, key, key, None)
    ref, _ = fast_attention.mqa_attention(None, query, key, key, None)
    assert torch.equal(out, ref)
