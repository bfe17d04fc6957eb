"""PI0 / PI0.5 fast serving path (agents/policies/pi0/fast.py) against lerobot's own
``sample_actions`` on the same inputs and noise: on a CPU in float32 (the computation), on a GPU
in bf16 with CUDA graphs (capture, padding to a bucket, new weights without recapture)."""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0.fast import FastPiSampler
from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (48, 48, 3), "wrist_image": (48, 48, 3)}, has_task=True)
CHUNK = 8
CLASSES = {"pi0": (Pi0Policy, Pi0PolicyConfig), "pi05": (Pi05Policy, Pi05PolicyConfig)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0fast")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    tasks = ["pick up the black bowl between the plate and the ramekin", "open the drawer", "x"]
    o = {"observation.state": torch.randn(b, 8, generator=g), "task": (tasks * b)[:b]}
    for c in ("image", "wrist_image"):
        o[f"observation.images.{c}"] = torch.randint(0, 256, (b, 48, 48, 3), dtype=torch.uint8, generator=g)
    return o


def make(ckpt, variant, **kw):
    cls, cfg_cls = CLASSES[variant]
    p = cls(cfg_cls(checkpoint=str(ckpt), chunk_size=CHUNK, lora_rank=4, **kw), SPEC)
    # trained-looking adapters and heads (fresh LoRA B is zero: folding would be a no-op), and
    # PI0.5's AdaRMS condition layers (lerobot initialises them to zero: the time would not count)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, prm in p.inner.named_parameters():
            if prm.requires_grad or ".dense.weight" in name:
                prm.add_(0.05 * torch.randn(prm.shape, generator=g).to(prm))
    return p.eval()


def both(p, o, noise):
    """(fast, lerobot) on the same observation and noise."""
    inputs = p.model_inputs(o)
    with torch.no_grad():
        fast = p.forward_model(inputs, noise)
        p.cfg.fast_serving, mode = "off", p.cfg.fast_serving
        try:
            ref = p.forward_model(inputs, noise)
        finally:
            p.cfg.fast_serving = mode
    return fast, ref


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_fast_path_equals_lerobot_on_cpu(ckpts, variant):
    p = make(ckpts[variant], variant, fast_serving="eager", device="cpu")
    noise = torch.randn(3, CHUNK, int(p.lr_cfg.max_action_dim), generator=torch.Generator().manual_seed(2))
    fast, ref = both(p, obs(), noise)
    assert p._fast is not None and p._fast.captures == 0  # eager: no graphs on a CPU
    assert fast.shape == ref.shape == (3, CHUNK, int(p.lr_cfg.max_action_dim))
    assert ref.abs().max() > 0.05  # the comparison is not between two near-zero outputs
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-4)
    # the noise matters and rows are independent (padding rows of other prompts do not leak)
    other, _ = both(p, obs(), noise.flip(0))
    assert not torch.allclose(other, fast, atol=1e-3)
    one, _ = both(p, {k: v[1:2] for k, v in obs().items()}, noise[1:2])
    torch.testing.assert_close(one[0], fast[1], atol=2e-5, rtol=1e-4)
    # act goes through it and gives the policy's actions
    a = p.act(obs(), noise=noise).actions
    p.cfg.fast_serving = "off"
    torch.testing.assert_close(a, p.act(obs(), noise=noise).actions, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_act_hands_the_frames_to_the_fast_path(ckpts, variant, monkeypatch):
    """Where the fast path serves, act hands it the cameras' frames as they came (uint8 [B, H,
    W, C]) with the policy's mapping to lerobot's images, run inside its graph on a GPU: the same
    actions as the mapped inputs give, bit for bit here (the same arithmetic); lerobot's path maps
    them first."""
    from agents.policies.pi0.fast import FastPiSampler

    p = make(ckpts[variant], variant, fast_serving="eager", device="cpu")
    noise = torch.randn(3, CHUNK, int(p.lr_cfg.max_action_dim), generator=torch.Generator().manual_seed(2))
    seen = []
    orig = FastPiSampler.sample

    def spy(self, images, *a, prep=None, **kw):
        seen.append((images[0].dtype, prep is not None))
        return orig(self, images, *a, prep=prep, **kw)

    monkeypatch.setattr(FastPiSampler, "sample", spy)
    a = p.act(obs(), noise=noise).actions
    assert seen == [(torch.uint8, True)]
    with torch.no_grad():
        mapped = p._postprocess(p.forward_model(p.model_inputs(obs()), noise))
    assert seen[-1] == (torch.float32, False)
    assert torch.equal(a, mapped)
    with torch.no_grad():  # the frames without the fast path: mapped before lerobot's sample_actions
        inputs = p._model_inputs(p.lerobot_batch(obs(), frames=True), frames=True)
        p.cfg.fast_serving = "off"
        torch.testing.assert_close(p._postprocess(p.forward_model(inputs, noise, frames=True)), a, atol=2e-5,
                                   rtol=1e-4)


def test_fast_path_is_not_used_for_training(ckpts):
    p = make(ckpts["pi0"], "pi0", fast_serving="eager", device="cpu").train()
    p._fast = None
    inputs = p.model_inputs(obs())
    with torch.no_grad():
        p.forward_model(inputs, None)
    assert p._fast is None
    with pytest.raises(ValueError, match="fast_serving"):
        Pi0PolicyConfig(checkpoint=str(ckpts["pi0"]), fast_serving="fastest").validate()


def test_fast_compile_setting():
    """``fast_compile``: auto compiles where graphs are captured (a GPU), true / false as said;
    anything else is refused when the config is validated."""
    from agents.policies.fast_common import COMPILE_MODE, resolve_compile

    assert resolve_compile("auto", True) == COMPILE_MODE and resolve_compile("auto", False) is None
    assert resolve_compile(True, False) == COMPILE_MODE and resolve_compile("true", False) == COMPILE_MODE
    assert resolve_compile(False, True) is None and resolve_compile("false", True) is None
    assert resolve_compile("static", True) == "static"
    assert Pi0PolicyConfig().fast_compile == "auto" and Pi0PolicyConfig().fast_warmup_buckets == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="fast_compile"):
        Pi0PolicyConfig(fast_compile="fastest").validate()


def test_the_compiles_take_inductor_options(ckpts, monkeypatch):
    """``FastPiSampler(inductor=...)`` reaches every compile of the fast path, beside autotune's
    option; without either, no options (a spy on torch.compile records them; it compiles)."""
    seen = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw.get("options"))
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    p = make(ckpts["pi0"], "pi0", fast_serving="eager", device="cpu")
    FastPiSampler(p.inner.model, "pi0", graphs=False, compile=True)
    FastPiSampler(p.inner.model, "pi0", graphs=False, compile=True, autotune=True, inductor={"combo_kernels": True})
    FastPiSampler(p.inner.model, "pi0", graphs=False, compile=True, inductor={"coordinate_descent_tuning": True})
    assert seen == [None] * 3 + [{"max_autotune": True, "combo_kernels": True}] * 3 \
        + [{"coordinate_descent_tuning": True}] * 3


def test_inference_server_warms_the_policy_up(ckpts):
    """The serving thread's owner warms the policy up when it is built (before it serves), with
    its max_batch; a policy without ``warm_up`` or one on a CPU (no graphs) costs nothing."""
    from learner.inference import InferenceServer

    class Warm:
        def __init__(self):
            self.calls = []

        def warm_up(self, *, max_batch):
            self.calls.append(max_batch)
            return {1: 0.5, 2: 0.25}

    def server(policy):
        s = InferenceServer(policy, reply=lambda *a: None, active_actors=lambda: 1, device=torch.device("cpu"),
                            max_batch=16)
        s.start()
        s.stop()
        s.join(timeout=5)
        return s

    w = Warm()
    assert server(w).warmup_s == {1: 0.5, 2: 0.25} and w.calls == [16]
    assert server(object()).warmup_s == {}
    p = make(ckpts["pi0"], "pi0", device="cpu")
    assert server(p).warmup_s == {} and getattr(p, "_fast", None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_default_config_compiles_and_warms_up_on_gpu(ckpts):
    """The default config on a GPU compiles the fast path; ``warm_up`` captures the listed
    buckets (3 pads to 4); with the batch dimension dynamic the bucket after 2 needs no compile;
    a later act at a warmed size neither captures nor compiles; actions match lerobot's."""
    from agents.policies.fast_common import compiled_graphs as _compiled_graphs

    p = make(ckpts["pi0"], "pi0", device="cuda", dtype="bfloat16")
    assert p.cfg.fast_compile == "auto" and p.cfg.fast_serving == "auto"
    assert sorted(p.warm_up([1, 2])) == [1, 2]
    fast = p._fast
    assert fast.compile == "dynamic" and fast.captures == 2 and fast.compiles > 0
    # the defaults on a GPU: bf16 SigLIP and every layer's projections fused (fast_fused.py)
    assert fast.levers.vision.dtype is torch.bfloat16 and fast.levers.fp8 is None
    assert fast.levers.fused_expert is not None and fast.levers.fused_vlm is not None and not fast.autotune
    compiled = _compiled_graphs()
    assert sorted(p.warm_up([3, 4, 128], max_batch=64)) == [4]  # 128: above max_batch, skipped
    assert fast.captures == 3 and _compiled_graphs() == compiled  # a capture only
    assert sorted(k[0] for k in fast._graphs) == [1, 2, 4]
    d = int(p.lr_cfg.max_action_dim)
    for b in (3, 1, 2):
        noise = torch.randn(b, CHUNK, d, generator=torch.Generator().manual_seed(b)).cuda()
        out, ref = both(p, obs(b), noise)
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        p.act(obs(b))
    assert fast.captures == 3 and _compiled_graphs() == compiled
    # a prompt of more token columns (another padded length): a capture, no compile
    long = dict(obs(1), task=["pick up the black bowl between the plate and the ramekin and put it " * 3])
    assert p.model_inputs(long)[2].shape[1] > p.model_inputs(obs(1))[2].shape[1]
    noise = torch.randn(1, CHUNK, d, generator=torch.Generator().manual_seed(9)).cuda()
    out, ref = both(p, long, noise)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    assert fast.captures == 4 and _compiled_graphs() == compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_graphs_equal_lerobot_on_gpu(ckpts, variant):
    # graphs without torch.compile: the replay must equal the same computation run eagerly
    p = make(ckpts[variant], variant, device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=False)
    d = int(p.lr_cfg.max_action_dim)
    noise = torch.randn(3, CHUNK, d, generator=torch.Generator().manual_seed(2)).cuda()
    fast, ref = both(p, obs(), noise)
    assert p._fast.captures == 1  # batch 3 -> the bucket of 4
    torch.testing.assert_close(fast, ref, atol=3e-2, rtol=3e-2)
    again, _ = both(p, obs(seed=4), noise)  # same bucket: a replay, no new capture
    assert p._fast.captures == 1 and not torch.allclose(again, fast)
    # new weights reach the replayed graph (the parameters are read in place): the replay
    # equals the same computation run without a graph, and lerobot's
    g = torch.Generator().manual_seed(3)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=g).to(v) for k, v in p.trainable_state_dict().items()}
    p.load_trainable_state_dict(state)
    p.eval()
    fast2, ref2 = both(p, obs(), noise)
    assert p._fast.captures == 1
    p.cfg.fast_serving, p._fast = "eager", None
    with torch.no_grad():
        plain = p.forward_model(p.model_inputs(obs()), noise)
    assert p._fast.captures == 0
    torch.testing.assert_close(fast2, plain, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(fast2, ref2, atol=3e-2, rtol=3e-2)
    assert not torch.allclose(fast2, fast, atol=1e-2)
    # act: the frames into a graph of their own, their mapping inside it, the same actions
    p.cfg.fast_serving, p._fast = "auto", None
    a = p.act(obs(), noise=noise).actions
    assert p._fast.captures == 1
    with torch.no_grad():
        torch.testing.assert_close(a, p._postprocess(p.forward_model(p.model_inputs(obs()), noise)), atol=1e-3,
                                   rtol=1e-3)
    assert p._fast.captures == 2


@pytest.mark.parametrize("hkv,q", [(1, 7), (2, 5), (1, 200)])
def test_grouped_head_attention_equals_eager_attention(hkv, q):
    """``mqa_attention`` (query heads sharing a key/value head as one GEMM; beyond MQA_MAX_ROWS
    rows it hands over to SDPA) equals transformers' eager attention with repeat_kv, padded keys
    masked, on the same inputs."""
    from types import SimpleNamespace

    from transformers.models.gemma.modeling_gemma import eager_attention_forward

    from agents.policies.pi0 import fast_attention as pi0_fast
    from agents.policies.pi0.fast_attention import _additive, mqa_attention

    g = torch.Generator().manual_seed(hkv * 100 + q)
    b, h, k, d = 2, 8, 23, 16
    query, key, value = (torch.randn(*s, generator=g) for s in ((b, h, q, d), (b, hkv, k, d), (b, hkv, k, d)))
    valid = torch.ones(b, q, k, dtype=torch.bool)
    valid[1, :, -6:] = False  # the second row's last keys are padding
    mask = _additive(valid, torch.float32)
    module = SimpleNamespace(num_key_value_groups=h // hkv, training=False, is_causal=False)
    ref, _ = eager_attention_forward(module, query, key, value, mask, scaling=d ** -0.5)
    out, _ = mqa_attention(module, query, key, value, mask, scaling=d ** -0.5)
    assert out.shape == ref.shape == (b, q, h, d)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (h // hkv) * q > pi0_fast.MQA_MAX_ROWS or not torch.allclose(
        out, mqa_attention(module, query, key.flip(2), value, mask)[0], atol=1e-3)
