"""OpenVLA-OFT's FP8 serving lever (policy.fast_llm_fp8, agents/policies/fp8.py) on the CPU with
``emulate`` (the same quantization, float32 products): every Llama linear runs FP8 inside the
fast path's call and nowhere else, the result stays within quantization error of the bf16 / fp32
path (and is not the same computation), new weights are re-quantized in place before the next
call, and ``true`` where no FP8 GEMM can run is refused when the policy is built."""

from __future__ import annotations

import pytest
import torch
import yaml

from agents.policies.fp8 import DECODER_LINEARS, Fp8Linear, dequantize, quantize_rows
from test_oft_fast import HEADS, SPEC, ckpt, make, obs, perturb  # noqa: F401 - the tiny checkpoint fixture

LINEARS_PER_LAYER = 7


def fp8_calls(p) -> list[int]:
    """A counter of Fp8Linear forwards on every stand-in of the policy's fast path."""
    calls = [0]

    def hook(*_):
        calls[0] += 1
    for site in p._fast.fp8.sites:
        site.fp8.register_forward_hook(hook)
    return calls


def plain(ckpt, head, **kw):
    """A tiny OFT without adapters (every Llama linear a plain nn.Linear), heads perturbed."""
    cls, cfg_cls = HEADS[head]
    torch.manual_seed(0)
    p = cls(cfg_cls(checkpoint=str(ckpt), chunk_size=4, lora_rank=0, fast_serving="eager", device="cpu",
                    **({"temperature": 1.5} if head == "discrete" else {}), **kw), SPEC)
    perturb(p)
    return p.eval()


def quantized_in_place(p) -> None:
    """The same arithmetic as the FP8 stand-ins, done to the model itself: each Llama linear's
    weight replaced by its dequantized e4m3 value, its input quantized per row on the way in."""
    lm = p.model.language_model.model
    with torch.no_grad():
        for layer in lm.layers[: lm.config.num_hidden_layers]:
            for block, names in DECODER_LINEARS:
                for name in names:
                    lin = getattr(getattr(layer, block), name)
                    lin.weight.copy_(dequantize(*quantize_rows(lin.weight)))
                    lin.register_forward_pre_hook(lambda _m, args: (dequantize(*quantize_rows(args[0])).to(args[0]),))


@pytest.mark.parametrize("head", ["l1", "discrete"])
def test_every_llama_linear_runs_fp8_in_the_call_exactly_as_quantized(ckpt, head):  # noqa: F811
    p = plain(ckpt, head, fast_llm_fp8="emulate")
    full, quant = plain(ckpt, head), plain(ckpt, head)
    quantized_in_place(quant)
    o = obs()
    with torch.no_grad():
        want_full = full.forward_model(full.model_inputs(o))
        want = quant.forward_model(quant.model_inputs(o))
        p.forward_model(p.model_inputs(o))   # builds the fast path and its stand-ins
        lm = p.model.language_model.model
        n_layers = lm.config.num_hidden_layers
        assert len(p._fast.fp8.sites) == n_layers * LINEARS_PER_LAYER and p._fast.fp8.skipped == []
        calls = fp8_calls(p)
        got = p.forward_model(p.model_inputs(o))
    assert calls[0] == n_layers * LINEARS_PER_LAYER          # each once per call, batch 3 in one pass
    # outside the call the model holds its own modules again
    assert not any(isinstance(m, Fp8Linear) for m in p.modules())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)       # the quantized arithmetic, exactly
    err, scale = (got - want_full).abs().max().item(), want_full.abs().max().item()
    assert 0 < err < 0.25 * scale, (err, scale)              # and not the unquantized one
    act = p.act(o, deterministic=True)
    assert act.actions.shape == (3, 4, 2) and torch.isfinite(act.actions).all()


def test_new_weights_are_requantized_before_the_next_call_and_training_never_sees_fp8(ckpt):  # noqa: F811
    p = make(ckpt, "l1", fast_serving="eager", device="cpu", fast_llm_fp8="emulate")
    ref = make(ckpt, "l1", fast_serving="eager", device="cpu")
    o = obs(b=2, seed=3)
    with torch.no_grad():
        before = p.forward_model(p.model_inputs(o))
        n0 = p._fast.fp8.requantized
        again = p.forward_model(p.model_inputs(o))
        assert p._fast.fp8.requantized == n0 and torch.equal(before, again)   # nothing changed: nothing re-done
    # new trainable weights, as a learner's publish writes them (load_trainable_state_dict)
    p.train()
    perturb(p, scale=0.3, seed=7)
    new = {k: v.detach().clone() for k, v in p.trainable_state_dict().items()}
    p.eval()
    ref.load_trainable_state_dict(new)
    with torch.no_grad():
        after = p.forward_model(p.model_inputs(o))
        want = ref.forward_model(ref.model_inputs(o))
    assert p._fast.fp8.requantized > n0
    assert (after - want).abs().max() < 0.25 * want.abs().max()           # tracks the new weights
    assert (after - before).abs().max() > 2 * (after - want).abs().max()  # not the old ones
    # a training step's forward and backward run the model's own modules
    p.train()
    seen = []
    handles = [s.fp8.register_forward_hook(lambda *_: seen.append(1)) for s in p._fast.fp8.sites]
    batch = {**obs(b=2), "action": torch.rand(2, 4, 2) * 2 - 1}
    p.bc_loss(batch).backward()
    for h in handles:
        h.remove()
    assert seen == [] and not any(isinstance(m, Fp8Linear) for m in p.modules())


def test_fp8_that_cannot_run_is_refused_at_build_and_bad_values_named(ckpt):  # noqa: F811
    with pytest.raises(RuntimeError, match=r"policy.fast_llm_fp8=true: no FP8 GEMMs here: the policy runs on 'cpu'"):
        make(ckpt, "discrete", device="cpu", fast_llm_fp8=True)
    with pytest.raises(ValueError, match="policy.fast_llm_fp8 must be false, true or emulate, got 'fp4'"):
        make(ckpt, "l1", device="cpu", fast_llm_fp8="fp4")
    for name in ("openvla_oft", "openvla_oft_discrete"):
        assert yaml.safe_load(open(f"config/policy/{name}.yaml"))["fast_llm_fp8"] is False


def test_the_serving_bench_times_each_head_with_and_without_fp8_in_one_run(tmp_path):
    """tools/bench/oft_fast.py --levers default,fp8 --tiny: both builds in one run, the FP8 one
    under ``<head>+fp8`` and off the bf16 path by its quantization (the default one on it)."""
    import json

    from tools.bench.oft_fast import main

    out = tmp_path / "oft.json"
    main(["--tiny", "--heads", "l1", "--levers", "default,fp8", "--batches", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == [] and set(d["heads"]) == {"l1", "l1+fp8"}
    assert d["heads"]["l1"]["max_abs_diff"] < 1e-4 < d["heads"]["l1+fp8"]["max_abs_diff"]
    assert d["heads"]["l1+fp8"]["by_batch"]["1"]["mfu"] > 0
    with pytest.raises(SystemExit, match="unknown lever 'fp4'"):
        main(["--tiny", "--levers", "fp4"])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@gpu
def test_fp8_graphs_on_gpu_track_the_bf16_path_and_new_weights_need_no_recapture(ckpt):  # noqa: F811
    """torch._scaled_mm inside the compiled, captured fast path (the production setting) computes
    the emulated quantization (float32 products of the same FP8 values and scales) to bf16
    round-off: nearer to it than to the bf16 path, and within quantization error of that."""
    p = make(ckpt, "l1", device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=True, fast_llm_fp8=True)
    ref = make(ckpt, "l1", device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=False)
    emu = make(ckpt, "l1", device="cuda", dtype="bfloat16", fast_serving="auto", fast_compile=False,
               fast_llm_fp8="emulate")
    o = obs()
    got, want, same = p.act(o).actions, ref.act(o).actions, emu.act(o).actions
    fp8, lm = p._fast.fp8, p.model.language_model.model
    assert fp8.mode == "cuda" and len(fp8.sites) + len(fp8.skipped) == lm.config.num_hidden_layers * LINEARS_PER_LAYER
    assert fp8.sites and p._fast.captures == 1
    assert (got - same).abs().max() < 0.5 * (got - want).abs().max()
    assert 0 < (got - want).abs().max() < 0.5 * want.abs().max()
    captures, n0 = p._fast.captures, fp8.requantized
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.2 * torch.randn(v.shape, generator=g).to(v) for k, v in p.trainable_state_dict().items()}
    p.load_trainable_state_dict(new)
    ref.load_trainable_state_dict(new)
    got2, want2 = p.act(o).actions, ref.act(o).actions
    assert p._fast.captures == captures and fp8.requantized > n0     # re-quantized in place, replayed
    assert (got2 - want2).abs().max() < 0.5 * want2.abs().max()
    assert (got2 - got).abs().max() > 2 * (got2 - want2).abs().max()
