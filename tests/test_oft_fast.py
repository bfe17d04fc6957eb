"""OpenVLA-OFT fast serving path (agents/policies/openvla_oft/fast.py) against the policies' eager path
on the same inputs: on a CPU in float32 (the computation, both heads), on a GPU in bf16 with
CUDA graphs (capture per bucket, padding, new weights without recapture, fold-state recapture)."""

from __future__ import annotations

import pytest
import torch

from agents.policies.openvla_oft.fast import FastOFT
from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_openvla_oft

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3), "wrist_image": (32, 32, 3)}, has_task=True)
CHUNK = 4
HEADS = {"l1": (OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig),
         "discrete": (OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig)}
TASKS = ["reach the red target", "pick up the black bowl between the plate and the ramekin and place it", "x"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_openvla_oft(tmp_path_factory.mktemp("oftfast") / "oft", SPEC, chunk_size=CHUNK)


def obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = {"observation.state": torch.rand(b, 4, generator=g), "task": (TASKS * b)[:b]}
    for c in ("image", "wrist_image"):
        o[f"observation.images.{c}"] = torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g)
    return o


def perturb(p, scale=0.05, seed=1):
    """Trained-looking adapters and heads (fresh LoRA B is zero: folding would be a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, prm in p.named_parameters():
            if prm.requires_grad:
                prm.add_(scale * torch.randn(prm.shape, generator=g).to(prm))


def make(ckpt, head, **kw):
    cls, cfg_cls = HEADS[head]
    if head == "discrete":
        kw.setdefault("temperature", 1.5)
    torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator
    p = cls(cfg_cls(checkpoint=str(ckpt), chunk_size=CHUNK, lora_rank=4, **kw), SPEC)
    perturb(p)
    return p.eval()


def eager_act(p, o, **kw):
    """The policy's own act with the fast path off."""
    mode, p.cfg.fast_serving = p.cfg.fast_serving, "off"
    try:
        return p.act(o, **kw)
    finally:
        p.cfg.fast_serving = mode


@pytest.mark.parametrize("head", ["l1", "discrete"])
def test_fast_path_equals_eager_act_on_cpu(ckpt, head):
    p = make(ckpt, head, fast_serving="eager", device="cpu")
    fast = p.act(obs(), deterministic=True)
    assert isinstance(p._fast, FastOFT) and p._fast.captures == 0  # eager: no graphs on a CPU
    ref = eager_act(p, obs(), deterministic=True)
    assert fast.actions.shape == ref.actions.shape == (3, CHUNK, 2)
    if head == "l1":
        assert ref.actions.std() > 0.05  # not a comparison of two constant outputs
    torch.testing.assert_close(fast.actions, ref.actions, atol=1e-5, rtol=1e-5)
    if head == "discrete":
        assert torch.equal(fast.extras["action_tokens"], ref.extras["action_tokens"])
        torch.testing.assert_close(fast.log_prob, ref.log_prob, atol=1e-5, rtol=1e-5)
    # the bare model call too (forward_model goes through the fast path in eval mode)
    inputs = p.model_inputs(obs())
    with torch.no_grad():
        f = p.forward_model(inputs)
        p.cfg.fast_serving = "off"
        r = p.forward_model(inputs)
        p.cfg.fast_serving = "eager"
    assert (r[0] - r[1]).abs().max() > 1e-2  # rows differ (discrete: logits, not just greedy tokens)
    torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)
    # rows are independent of the batch and of the token padding (another length bucket)
    one = p.act({k: v[1:2] for k, v in obs().items()}, deterministic=True)
    torch.testing.assert_close(one.actions[0], fast.actions[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        wide = FastOFT(p, graphs=False, token_multiple=128).run(p.model_inputs(obs()))
    assert wide["actions"].shape == fast.actions.shape
    torch.testing.assert_close(wide["actions"], fast.actions, atol=1e-5, rtol=1e-5)


def test_discrete_sampling_and_log_probs_on_cpu(ckpt):
    p = make(ckpt, "discrete", fast_serving="eager", device="cpu")
    o = obs(4)
    with torch.no_grad():
        p.cfg.fast_serving = "off"
        logits = p.action_logits(p.action_hidden(o))  # the eager path's tempered logits
        p.cfg.fast_serving = "eager"
    # Gumbel-max with the same noise gives argmax(logits + g)
    g = -torch.empty(logits.shape).exponential_(generator=torch.Generator().manual_seed(5)).log()
    with torch.no_grad():
        out = p.fast_path().run(p.model_inputs(o), g)
    assert torch.equal(out["cls"], (logits + g).argmax(-1))
    assert not torch.equal(out["cls"], logits.argmax(-1))  # the noise matters
    # sampled act: fresh tokens per call; the act-time log-prob equals what the update recomputes
    c1 = p.act(o)
    c2 = p.act(o)
    assert not torch.equal(c1.extras["action_tokens"], c2.extras["action_tokens"])
    batch = dict(o, **{"extra.action_tokens": c1.extras["action_tokens"]})
    p.train()
    lp = p.log_prob(batch, c1.actions)
    assert lp.requires_grad
    torch.testing.assert_close(lp.detach(), c1.log_prob, atol=1e-4, rtol=0)
    assert torch.allclose(p.log_prob(o, c1.actions).detach(), c1.log_prob, atol=1e-4)


def test_fast_path_selection_and_new_weights_on_cpu(ckpt):
    p = make(ckpt, "l1", device="cpu")  # fast_serving=auto: eager path on a CPU
    p.act(obs())
    assert p.__dict__.get("_fast") is None
    p.cfg.fast_serving = "eager"
    p.train()
    with torch.no_grad():
        p.forward_model(p.model_inputs(obs()))
    assert p.__dict__.get("_fast") is None  # training mode: never the fast path
    p.eval()
    with pytest.raises(ValueError, match="fast_serving"):
        OpenVLAOFTPolicyConfig(checkpoint=str(ckpt), fast_serving="fastest").validate()
    before = p.act(obs()).actions
    assert p.lora.folded  # served with the adapters folded in
    state = p.trainable_state_dict()
    g = torch.Generator().manual_seed(7)
    p.load_trainable_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()})
    after = p.act(obs()).actions
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, eager_act(p, obs()).actions, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="camera"):  # bad input is still named
        p.act({k: v for k, v in obs().items() if k != "observation.images.image"})


# -- GPU: CUDA graphs ---------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _no_graph(p, o, gumbel=None):
    """The same fast computation run eagerly (no graph) on the same device and weights."""
    with torch.no_grad():
        return FastOFT(p, graphs=False).run(p.model_inputs(o), gumbel)


@gpu
def test_graphs_equal_eager_on_gpu_l1(ckpt):
    p = make(ckpt, "l1", device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=False)
    fast = p.act(obs()).actions
    assert p._fast.captures == 1  # batch 3 -> the bucket of 4
    torch.testing.assert_close(fast, _no_graph(p, obs())["actions"], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fast, eager_act(p, obs()).actions, atol=3e-2, rtol=3e-2)
    again = p.act(obs(seed=4)).actions  # same bucket: a replay, no new capture
    assert p._fast.captures == 1 and not torch.allclose(again, fast)
    torch.testing.assert_close(again, _no_graph(p, obs(seed=4))["actions"], atol=1e-2, rtol=1e-2)
    p.act(obs(4))  # batch 4: the same bucket
    p.act(obs(1))  # batch 1: a new one
    assert p._fast.captures == 2
    # new weights reach the replayed graph: no recapture, equals the ungraphed computation
    g = torch.Generator().manual_seed(3)
    state = p.trainable_state_dict()
    p.load_trainable_state_dict({k: v + 0.2 * torch.randn(v.shape, generator=g).to(v) for k, v in state.items()})
    fast2 = p.act(obs()).actions
    assert p._fast.captures == 2
    assert not torch.allclose(fast2, fast, atol=1e-2)
    torch.testing.assert_close(fast2, _no_graph(p, obs())["actions"], atol=1e-2, rtol=1e-2)
    # a change of the adapter fold state runs other modules: a new capture
    p.cfg.fold_lora_for_serving = False
    unfolded = p.act(obs()).actions
    assert p._fast.captures == 3 and not p.lora.folded
    torch.testing.assert_close(unfolded, _no_graph(p, obs())["actions"], atol=1e-2, rtol=1e-2)
    # folded (W0 + BA rounded to bf16) vs unfolded (W0 x + B A x): the same function up to
    # bf16 rounding of adapters perturbed by 0.2 sigma (H100: at most 0.056, 1 of 24 values)
    torch.testing.assert_close(unfolded, fast2, atol=0.1, rtol=0.1)


@gpu
def test_graphs_equal_eager_on_gpu_discrete(ckpt):
    p = make(ckpt, "discrete", device="cuda", dtype="bfloat16", fast_serving="graphs", fast_compile=False)
    o = obs(3)
    greedy = p.act(o, deterministic=True)
    assert p._fast.captures == 1
    ref = _no_graph(p, o)
    torch.testing.assert_close(greedy.log_prob, ref["logp"], atol=5e-2, rtol=1e-2)
    assert (greedy.extras["action_tokens"] == ref["cls"]).float().mean() > 0.9  # bf16 near-ties aside
    # sampling inside the graph: fresh noise per replay, same graph as greedy
    s1, s2 = p.act(o), p.act(o)
    assert p._fast.captures == 1
    assert not torch.equal(s1.extras["action_tokens"], s2.extras["action_tokens"])
    # the act-time log-prob is that of the returned tokens under the served logits, and close to
    # what the update recomputes with live adapters
    with torch.no_grad():
        logits = p.forward_model(p.model_inputs(o))
    lp = logits.log_softmax(-1).gather(-1, s1.extras["action_tokens"][..., None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(s1.log_prob, lp, atol=1e-3, rtol=1e-4)
    p.train()
    with torch.no_grad():
        upd = p.log_prob(dict(o, **{"extra.action_tokens": s1.extras["action_tokens"]}), s1.actions)
    torch.testing.assert_close(upd, s1.log_prob, atol=0.15, rtol=0.02)


@gpu
def test_default_config_compiles_and_warms_up_on_gpu(ckpt):
    """The default config on a GPU compiles the LM layers with the batch (>= 2) and the token
    length symbolic: warm-up compiles batch 1 and 2, then a bucket of 4 or a longer prompt costs
    a capture and no compile; the compiled graphs equal the ungraphed, uncompiled computation
    within bf16 tolerance."""
    from agents.policies.fast_common import compiled_graphs

    p = make(ckpt, "l1", device="cuda", dtype="bfloat16")
    assert p.cfg.fast_compile == "auto" and p.cfg.fast_warmup_buckets == (1, 2, 4, 8)
    assert sorted(p.warm_up([1, 2])) == [1, 2]
    fast = p._fast
    assert fast.compile == "dynamic" and fast.captures == 2 and fast.compiles > 0
    compiled = compiled_graphs()
    assert sorted(p.warm_up([3, 128], max_batch=64)) == [4]  # 128: above max_batch, skipped
    long = dict(obs(1), task=["pick up the black bowl between the plate and the ramekin and place it " * 3])
    ids_short, ids_long = (fast._prepare(p.model_inputs(o), None)["ids"].shape[1] for o in (obs(1), long))
    assert ids_long > ids_short  # another token bucket
    for o in (obs(3), obs(1), long):
        torch.testing.assert_close(p.act(o).actions, _no_graph(p, o)["actions"], atol=3e-2, rtol=3e-2)
    # the long prompt (and any other token bucket met): captures only
    assert fast.captures == len(fast._graphs) >= 4 and compiled_graphs() == compiled


@pytest.mark.slow
def test_bench_smoke_on_cpu(tmp_path):
    """tools/bench/oft_fast.py --tiny: every section runs and the JSON holds its figures."""
    import json

    from tools.bench.oft_fast import main

    out = tmp_path / "oft.json"
    main(["--tiny", "--batches", "1,2", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == [] and d["peak_matmul"]["tflops"] > 0
    for head in ("l1", "discrete"):
        r = d["heads"][head]
        assert r["fast_act_ms"]["n"] >= 3 and r["eager_act_ms"]["p50"] > 0
        assert r["max_abs_diff"] < 1e-4 and r["captures"] == 0
        by = r["by_batch"]
        assert by["2"]["flops"] > 1.5 * by["1"]["flops"] > 0 and by["1"]["mfu"] > 0
