"""The denoising steps' keys/values in per-call buffers (agents/policies/pi0/fast_attention.py,
``FastPiSampler(step_kv=True)``): the suffix written in place into ``[suffix | prefix | pad]``
buffers, the steps' mask built once a call. The same attention over the same keys, so on a CPU
the actions equal the concatenating path's and lerobot's to float32 round-off (prompts of
different lengths in one batch: padded prefix keys), alone, with the fused projections and in
the flow-RL chain; on a GPU (skipped without CUDA) under CUDA graphs and the compiled steps,
lerobot's within the bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0.fast import FastPiSampler
from agents.policies.pi0.fast_attention import StepKV, _PrefixKV
from test_pi0_fast import CHUNK, both, make, obs
from test_pi0_fused import CPU_TOL, GPU_TOL, ckpts  # noqa: F401 - the module's checkpoints
from test_pi0_levers import noise_for, perturb


def policy(ckpts, variant="pi0", **kw):  # noqa: F811
    torch.manual_seed(0)
    kw.setdefault("fast_serving", "eager")
    kw.setdefault("device", "cpu")
    return make(ckpts[variant], variant, **kw)


def sampler(p, **kw):
    return FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, **kw)


@pytest.fixture
def built(monkeypatch):
    """How many StepKV the fast path built (a spy: the class itself runs unchanged)."""
    from agents.policies.pi0 import fast

    n = []

    class Counted(StepKV):
        def __init__(self, *a, **kw):
            n.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(fast, "StepKV", Counted)
    return n


def test_buffers_hold_suffix_prefix_and_padding():
    b, hkv, p_len, d, s = 2, 1, 13, 4, 6
    prefix = _PrefixKV(2)
    prefix.k = [torch.randn(b, hkv, p_len, d) for _ in range(2)]
    prefix.v = [torch.randn(b, hkv, p_len, d) for _ in range(2)]
    pad = torch.ones(b, p_len, dtype=torch.bool)
    pad[1, -3:] = False
    ar = (torch.arange(s) < 2).float()
    kv = StepKV(prefix, pad, s, ar, torch.float32)
    assert kv.k[0].shape == (b, hkv, 24, d) and kv.mask.shape == (b, 1, s, 24)  # 6 + 13 -> 24
    assert torch.equal(kv.k[1][:, :, s:s + p_len], prefix.k[1])
    key, value = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    k, v = kv.update(key, value, 1)
    assert k is kv.k[1] and torch.equal(k[:, :, :s], key) and torch.equal(v[:, :, :s], value)
    assert torch.equal(k[:, :, s:s + p_len], prefix.k[1])  # the prefix stays
    visible = kv.mask == 0
    assert visible[0, 0, :, s:s + p_len].all() and not visible[1, 0, :, s + p_len - 3:s + p_len].any()
    assert not visible[..., s + p_len:].any()  # the padding to a multiple of 8
    assert visible[0, 0, 0, :1].all() and not visible[0, 0, 0, 1:s].any()  # the state token sees itself
    assert visible[0, 0, 2, :s].all()  # an action token sees the state and every action token


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("fuse", [None, "all"])
def test_step_buffers_equal_the_concatenating_path(ckpts, variant, fuse, built):  # noqa: F811
    p = policy(ckpts, variant)
    noise = noise_for(p)
    o = obs()  # three prompts of different lengths: padded prefix keys
    p._fast = sampler(p, fuse=fuse)
    plain, ref = both(p, o, noise)
    assert not built
    p._fast = sampler(p, fuse=fuse, step_kv=True)
    out, _ = both(p, o, noise)
    assert len(built) == 1  # once a call
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    perturb(p)  # new weights: the buffers are rebuilt each call from the new prefix
    new, ref2 = both(p, o, noise)
    assert float((new - out).abs().max()) > 0.1
    torch.testing.assert_close(new, ref2, **CPU_TOL)


def test_step_buffers_in_the_flow_rl_chain(ckpts, built):  # noqa: F811
    from agents import registry
    from test_pi0_fast import SPEC

    cfg = {"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK, "lora_rank": 4, "device": "cpu",
           "fast_serving": "eager", "flow_rl": "noise", "num_inference_steps": 4}
    torch.manual_seed(0)
    p = registry.build_policy(cfg, SPEC).eval()
    noise = noise_for(p)
    with torch.no_grad():
        p._fast_sampler()
    p._fast.step_kv = True
    a = p.act(obs(), deterministic=True, noise=noise).actions
    assert built
    p._fast.step_kv = False
    b = p.act(obs(), deterministic=True, noise=noise).actions
    torch.testing.assert_close(a, b, **CPU_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("attention", ["mqa", "flex", "triton"])
def test_step_buffers_under_graphs_and_compile_on_gpu(ckpts, variant, attention):  # noqa: F811
    """The step buffers (and the fused attention kernels: FlexAttention, the Triton kernels)
    under CUDA graphs and the compiled steps with the GPU defaults: lerobot's actions within the
    bf16 tolerance, new weights with no capture."""
    p = policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto")
    noise = noise_for(p)
    plain, ref = both(p, obs(), noise)
    levers = p._fast.levers
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=True, compile=True, step_kv=True,
                            step_attention=attention, vision_dtype=levers.vision.dtype, fuse="all")
    out, _ = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(out, ref, **GPU_TOL)
    torch.testing.assert_close(out, plain, **GPU_TOL)
    perturb(p)
    new, ref2 = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(new, ref2, **GPU_TOL)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("step_kv", [False, True])
def test_flex_step_attention_equals_the_default(ckpts, variant, step_kv):  # noqa: F811
    """FlexAttention for the denoising steps (eager on a CPU: torch's reference computation)
    computes what ``mqa_attention`` computes: the same actions to float32 round-off, with and
    without the step buffers; the prefix pass keeps its own attention."""
    from agents.policies.pi0 import fast_attention

    p = policy(ckpts, variant)
    noise = noise_for(p)
    p._fast = sampler(p)
    plain, ref = both(p, obs(), noise)
    calls = []
    orig = fast_attention.flex_step_attention

    def counted(*a, **kw):
        calls.append((a[1].shape[2], None if a[4] is None else a[4].shape[2]))  # query rows, mask rows
        return orig(*a, **kw)

    from transformers import AttentionInterface

    AttentionInterface._global_mapping[fast_attention.FLEX_NAME] = counted  # noqa: SLF001
    try:
        p._fast = sampler(p, step_kv=step_kv, step_attention="flex")
        out, _ = both(p, obs(), noise)
    finally:
        AttentionInterface._global_mapping[fast_attention.FLEX_NAME] = orig  # noqa: SLF001
    layers = p.inner.model.paligemma_with_expert.gemma_expert.model.config.num_hidden_layers
    steps = int(p.lr_cfg.num_inference_steps)
    rows = CHUNK + (variant == "pi0")
    assert len(calls) == layers * steps and {c[0] for c in calls} == {rows}  # the steps only
    assert {c[1] for c in calls} == {rows}
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    with pytest.raises(ValueError, match="step_attention"):
        sampler(p, step_attention="flash")


def test_the_policy_setting_turns_the_buffers_on(ckpts, built):  # noqa: F811
    """``policy.fast_step_kv``: auto by default (config and shipped YAML: on where the fast path
    runs on a GPU, off elsewhere), true builds the fast path with the buffers (the same actions),
    anything else is refused naming the setting."""
    import yaml

    from agents.policies.pi0.config import Pi0PolicyConfig
    from agents.policies.pi0.fast_levers import lever_settings

    assert Pi0PolicyConfig().fast_step_kv == "auto"
    for name in ("pi0", "pi05"):
        assert yaml.safe_load(open(f"config/policy/{name}.yaml"))["fast_step_kv"] == "auto"
    assert lever_settings(Pi0PolicyConfig(), cuda=True)["step_kv"] is True
    assert lever_settings(Pi0PolicyConfig())["step_kv"] is False
    with pytest.raises(ValueError, match="policy.fast_step_kv"):
        Pi0PolicyConfig(fast_step_kv="sometimes").validate()
    noise = None
    outs = []
    for on in (False, True):
        p = policy(ckpts, "pi0", fast_step_kv=on).eval()
        noise = noise_for(p) if noise is None else noise
        with torch.no_grad():
            assert p._fast_sampler().step_kv is on
            outs.append(p.act(obs(), deterministic=True, noise=noise).actions)
    assert len(built) == 1  # the buffers, on the second policy's act only
    torch.testing.assert_close(outs[0], outs[1], **CPU_TOL)


def test_the_softmax_key_count_is_bounded_when_compiled():
    """:func:`mqa_attention` under dynamo with the key count symbolic: the graph is traced with
    the count at most ``SOFTMAX_BOUND`` (its range narrowed: what inductor needs to run the
    softmax as one persistent reduction), counts within it share that graph, and a count past it
    gets a graph of its own; each gives eager's result."""
    from agents.policies.pi0.fast_attention import SOFTMAX_BOUND, mqa_attention

    ranges = []

    def backend(gm, example_inputs):
        env = torch._guards.TracingContext.get().fake_mode.shape_env  # noqa: SLF001
        vals = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
        ranges.append({int(vals[s]): (int(r.lower), r.upper) for s, r in env.var_to_range.items() if s in vals})
        return gm.forward

    def attend(q, k, v, m):
        return mqa_attention(None, q, k, v, m)[0]

    torch._dynamo.reset()  # noqa: SLF001
    fn = torch.compile(attend, backend=backend)
    g = torch.Generator().manual_seed(0)
    for keys in (40, 48, 1200):
        q = torch.randn(2, 8, 6, 16, generator=g)
        k, v = (torch.randn(2, 1, keys, 16, generator=g) for _ in range(2))
        m = torch.zeros(2, 1, 6, keys)
        m[..., -3:] = torch.finfo(torch.float32).min
        for t, dim in ((k, 2), (v, 2), (m, 3)):
            torch._dynamo.maybe_mark_dynamic(t, dim)  # noqa: SLF001
        torch.testing.assert_close(fn(q, k, v, m), attend(q, k, v, m))
        if keys == 48:
            assert len(ranges) == 1  # the first graph again
    assert len(ranges) == 2
    low, high = ranges
    assert low[40][1] <= SOFTMAX_BOUND  # the key count's upper bound, where a bound was unknown
    assert high[1200][0] > SOFTMAX_BOUND
    torch._dynamo.reset()  # noqa: SLF001
