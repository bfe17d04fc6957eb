"""The denoising steps' decoder layers as Triton kernels (agents/policies/pi0/fast_step_layers.py,
``FastPiSampler(step_layers="triton")``). On a CPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported: a subprocess): each equals the torch
computation it replaces (RMS norm with its weight, q/k/v, rotary; norm, gelu_tanh(gate) x up;
projection + residual) to float32 round-off on PI0's head layout and on odd sizes; PI0's actions
with them equal the default path's and lerobot's, and new weights (LoRA and norm weights written
in place) are re-folded before the next call; PI0.5's AdaRMS norms (scale and shift into the
GEMMs, the gated residuals) likewise. Without the interpreter a CPU runs the layers as they are.
The GPU tests (compiled, under CUDA graphs; the kernel bench) are skipped without CUDA."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem_testutil import python_code
from test_pi0_fast import both, obs
from test_pi0_fused import CPU_TOL, GPU_TOL, ckpts  # noqa: F401 - the module's checkpoints
from test_pi0_levers import noise_for, perturb

pytest.importorskip("triton")


def rms(x, w, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + eps) * (1 + w.float())).to(x.dtype)


def rotary(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def kernel_checks() -> None:
    """Run under the interpreter: each kernel against the torch computation it replaces."""
    from agents.policies.pi0 import fast_step_kernels as kernels

    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    # (batch, suffix, width, heads, kv heads, head dim, mlp): PI0's layout small, odd sizes
    for b, s, width, h, hkv, d, inter in [(2, 5, 32, 8, 1, 8, 40), (1, 51, 64, 4, 2, 32, 96), (3, 7, 48, 2, 1, 16, 24)]:
        m, eps = b * s, 1e-6
        x, n1, n2 = rand(m, width), rand(width, scale=0.3), rand(width, scale=0.3)
        wq, wk, wv = rand(h * d, width, scale=0.1), rand(hkv * d, width, scale=0.1), rand(hkv * d, width, scale=0.1)
        cos, sin = rand(b, s, d), rand(b, s, d)
        kbuf, vbuf = torch.zeros(b, hkv, s + 9, d), torch.zeros(b, hkv, s + 9, d)  # [suffix | more rows]
        q = kernels.qkv_rope(x, torch.cat([wq, wk, wv]) * (1 + n1)[None], cos.reshape(m, d), sin.reshape(m, d),
                             kbuf, vbuf, s, h, eps)
        hn = rms(x, n1, eps)

        def heads(t, n):
            return t.view(b, s, n, d).transpose(1, 2)

        c, sn = cos[:, None], sin[:, None]
        tol = dict(atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(q, rotary(heads(hn @ wq.T, h), c, sn), **tol)
        torch.testing.assert_close(kbuf[:, :, :s], rotary(heads(hn @ wk.T, hkv), c, sn), **tol)
        torch.testing.assert_close(vbuf[:, :, :s], heads(hn @ wv.T, hkv), **tol)
        assert not kbuf[:, :, s:].any() and not vbuf[:, :, s:].any()  # the rows past the suffix untouched
        # o_proj over attention's output as its GEMM writes it, [B, H, S, D]
        wo, res = rand(width, h * d, scale=0.1), rand(m, width)
        torch.testing.assert_close(kernels.linear_residual(q, wo, res),
                                   res + q.transpose(1, 2).reshape(m, h * d) @ wo.T, **tol)
        wg, wu = rand(inter, width, scale=0.1), rand(inter, width, scale=0.1)
        act = kernels.gate_up(x, torch.cat([wg, wu]) * (1 + n2)[None], eps)
        hn2 = rms(x, n2, eps)
        torch.testing.assert_close(act, torch.nn.functional.gelu(hn2 @ wg.T, approximate="tanh") * (hn2 @ wu.T), **tol)
        wd, res = rand(width, inter, scale=0.1), rand(m, width)
        torch.testing.assert_close(kernels.linear_residual(act, wd, res), res + act @ wd.T, **tol)
        # PI0.5's AdaRMS: x r (1 + scale) + shift into the GEMM, the gated residual after it
        mod = rand(1, 3 * width, scale=0.5)
        scale, shift, gate = mod.chunk(3, dim=-1)
        ada = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1 + scale) + shift
        w = torch.cat([wq, wk, wv])
        q = kernels.qkv_rope(x, w, cos.reshape(m, d), sin.reshape(m, d), kbuf, vbuf, s, h, eps, mod, shift @ w.T)
        torch.testing.assert_close(q, rotary(heads(ada @ wq.T, h), c, sn), **tol)
        torch.testing.assert_close(vbuf[:, :, :s], heads(ada @ wv.T, hkv), **tol)
        w = torch.cat([wg, wu])
        act = kernels.gate_up(x, w, eps, mod, shift @ w.T)
        torch.testing.assert_close(act, torch.nn.functional.gelu(ada @ wg.T, approximate="tanh") * (ada @ wu.T), **tol)
        torch.testing.assert_close(kernels.linear_residual(act, wd, res, gate), res + (act @ wd.T) * gate, **tol)
    print("kernels ok")


def with_norms(p, seed=4):
    """Non-zero RMS norm weights in PI0's expert (lerobot initialises them to zero: folding 1 + 0
    would go unchecked)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in p.inner.model.paligemma_with_expert.gemma_expert.model.layers:
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                if getattr(n, "dense", None) is None:  # PI0.5's AdaRMS norms have no weight
                    n.weight.copy_(0.3 * torch.randn(n.weight.shape, generator=g))
    return p


def sampler_checks(root: str, variant: str = "pi0") -> None:
    """Run under the interpreter: PI0's or PI0.5's actions with the step layers."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_pi0_fast import CHUNK, SPEC, make

    from agents.policies.pi0 import fast_step_kernels as kernels
    from agents.policies.pi0.fast import FastPiSampler
    from tools.make_tiny_checkpoints import make_pi0

    torch.manual_seed(0)
    p = with_norms(make(make_pi0(Path(root) / variant, SPEC, variant=variant, chunk_size=CHUNK), variant,
                        fast_serving="eager", device="cpu"))
    noise = noise_for(p)
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, step_kv=True)
    plain, ref = both(p, obs(), noise)
    calls = []
    orig = kernels.qkv_rope

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return orig(*a, **kw)

    kernels.qkv_rope = counted
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, step_kv=True, step_layers="triton")
    out, _ = both(p, obs(), noise)
    layers = p.inner.model.paligemma_with_expert.gemma_expert.model.config.num_hidden_layers
    assert len(calls) == layers * int(p.lr_cfg.num_inference_steps)  # every expert layer of every step
    assert set(calls) == {3 * (CHUNK + (variant == "pi0"))}  # rows: the batch x the suffix (PI0: + the state)
    torch.testing.assert_close(out, plain, **CPU_TOL)
    torch.testing.assert_close(out, ref, **CPU_TOL)
    # new weights: LoRA and heads pushed (perturb), a norm weight written in place
    before = p._fast.step_layers.refreshed
    perturb(p)
    with_norms(p, seed=5)
    new, ref2 = both(p, obs(), noise)
    assert p._fast.step_layers.refreshed > before
    assert float((new - out).abs().max()) > 1e-3  # the new weights count
    torch.testing.assert_close(new, ref2, **CPU_TOL)
    # with the fused projections: the kernels for calls within max_rows, the fused layers beyond
    for max_rows, kernel_calls in ((3 * (CHUNK + 1), True), (8, False)):
        calls.clear()
        p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile=None, step_kv=True,
                                step_layers="triton", step_layers_max_rows=max_rows, fuse="all")
        out, _ = both(p, obs(), noise)
        assert bool(calls) is kernel_calls
        torch.testing.assert_close(out, ref2, **CPU_TOL)
    print("sampler ok")


def test_kernels_equal_torch_under_the_interpreter():
    assert "kernels ok" in python_code("import test_pi0_step_layers as t; t.kernel_checks()", timeout=900)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_actions_with_step_layers_equal_the_default_path(tmp_path, variant):
    code = f"import test_pi0_step_layers as t; t.sampler_checks({str(tmp_path)!r}, {variant!r})"
    assert "sampler ok" in python_code(code, timeout=900)


def test_settings_fallbacks_and_pi05(ckpts):  # noqa: F811
    """The lever needs the step buffers and excludes FP8; on a CPU without the interpreter the
    layers run as they are (the same actions)."""
    from agents.policies.pi0 import fast_step_kernels
    from agents.policies.pi0.fast import FastPiSampler
    from test_pi0_step_kv import policy

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernels on a CPU")
    assert not fast_step_kernels.available("cpu")
    for variant in ("pi0", "pi05"):
        p = with_norms(policy(ckpts, variant))
        noise = noise_for(p)
        model = p.inner.model
        with pytest.raises(ValueError, match="step_layers"):
            FastPiSampler(model, p.variant, graphs=False, step_layers="triton")
        with pytest.raises(ValueError, match="step_layers"):
            FastPiSampler(model, p.variant, graphs=False, step_kv=True, step_layers="cuda")
        p._fast = FastPiSampler(model, p.variant, graphs=False, step_kv=True)
        plain, _ = both(p, obs(), noise)
        p._fast = FastPiSampler(model, p.variant, graphs=False, step_kv=True, step_layers="triton")
        out, _ = both(p, obs(), noise)
        assert len(p._fast.step_layers.sites) == 2  # every expert layer of the tiny checkpoint
        torch.testing.assert_close(out, plain, **CPU_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_step_layers_under_graphs_and_compile_on_gpu(ckpts, variant):  # noqa: F811
    """The kernels compiled into the steps under CUDA graphs with the GPU defaults: lerobot's
    actions within the bf16 tolerance, new weights re-folded with no capture."""
    from agents.policies.pi0.fast import FastPiSampler
    from test_pi0_step_kv import policy

    p = with_norms(policy(ckpts, variant, device="cuda", dtype="bfloat16", fast_serving="auto"))
    noise = noise_for(p)
    plain, ref = both(p, obs(), noise)
    levers = p._fast.levers
    p._fast = FastPiSampler(p.inner.model, p.variant, graphs=True, compile=True, step_kv=True, step_layers="triton",
                            vision_dtype=levers.vision.dtype, fuse="all")
    out, _ = both(p, obs(), noise)
    assert p._fast.captures == 1
    torch.testing.assert_close(out, ref, **GPU_TOL)
    torch.testing.assert_close(out, plain, **GPU_TOL)
    perturb(p)
    with_norms(p, seed=5)
    new, ref2 = both(p, obs(), noise)
    assert p._fast.captures == 1 and p._fast.step_layers.refreshed > 0
    torch.testing.assert_close(new, ref2, **GPU_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_kernel_bench_runs_on_gpu(tmp_path):
    """tools/bench/pi0_step_kernels.py at batch 1: every kernel and its reference timed, and the
    kernels equal their references within bf16 round-off at PI0's full expert shapes."""
    import json

    from tools.bench import pi0_step_kernels as bench

    for name, (ref, kern, _, _) in bench.cases(1).items():  # (q, and the buffers written, for qkv)
        torch.testing.assert_close(kern().float(), ref().float(), atol=6e-2, rtol=3e-2, msg=name)
    assert bench.main(["--batches", "1", "--json", str(tmp_path / "k.json")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["batches"]["1"]
    assert set(rows) == {"qkv", "gate_up", "o_residual", "down_residual"}
    assert all(r["kernel_us"] > 0 and r["reference_us"] > 0 for r in rows.values())


def test_the_kernels_compile_for_hopper(tmp_path):
    """Each kernel, in each of its variants (AdaRMS, attention's layout, the gate), compiles for
    an H100/H200 (sm_90) with the default tiles of both regimes (batch 1, larger batches),
    without a GPU (Triton's own compiler and the ptxas it ships), into a pipelined loop
    (asynchronous copies) on Hopper's warp-group MMA, within the shared memory an SM has
    (227 KB), with no register spills (ptxas's own report)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    import triton

    from agents.policies.pi0 import fast_step_kernels as kernels

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ints = {"M", "S", "K", "H", "HKV", "N", "XH", "sxm", "swn", "scm", "skb", "skh", "skn", "svb", "svh", "svn", "srm",
            "som"}
    aligned = ints - {"M", "S", "H", "HKV", "XH"}  # what the JIT specializes as multiples of 16 at PI0's sizes
    cases = [(kernels._qkv_kernel, "qkv", dict(D=256, HALF=128), ("ADA",)),
             (kernels._gate_up_kernel, "gate_up", {}, ("ADA",)),
             (kernels._residual_kernel, "residual", dict(XD=256), ("GATED",))]
    for (fn, tile, consts, flags), regime in itertools.product(cases, ("", "@batch")):
        bm, bn, bk, warps, stages = kernels.TILES[tile + regime]
        for on in (False, True):
            c = {**consts, "BM": bm, "BN": bn, "BK": bk, **{f: on for f in flags}}
            if tile == "residual" and not on:
                c["XD"] = 0
            sig = {a: "constexpr" if a in c else "i32" if a in ints else "fp32" if a == "eps" else "*bf16"
                   for a in fn.arg_names}
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
                     if sig[a] == "*bf16" or a in aligned}
            out = compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            ptx = out.asm["ptx"]
            assert "wgmma.mma_async" in ptx and "cp.async" in ptx, (tile, c)
            assert out.metadata.shared <= 227 * 1024, (tile, c, out.metadata.shared)
            (tmp_path / "k.ptx").write_text(ptx)  # ptxas's own report: registers, and no spills
            said = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(tmp_path / "k.ptx"), "-o",
                                   str(tmp_path / "k.cubin")], capture_output=True, text=True).stderr
            assert "Used" in said and "0 bytes spill stores" in said, (tile, regime, c, said[-500:])


def hopper_driver() -> None:
    """Triton's active driver set to a stand-in that names an sm_90 target (what inductor's
    analysis of a user kernel asks for); for subprocesses without a GPU only."""
    import triton
    from triton.backends.compiler import GPUTarget

    class Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Target())


def mutation_checks() -> None:
    """Run in a subprocess (:func:`hopper_driver`): what inductor's analysis finds each kernel
    writes, and that a compiled step writes the buffers in place (its post-grad graph after
    inductor's reinplacing: no copy of any input, no clone)."""
    hopper_driver()
    from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

    from agents.policies.pi0 import fast_step_kernels as kernels

    def args(fn, **given):
        return {a: given.get(a, torch.empty(4, dtype=torch.bfloat16)) for a in fn.arg_names}

    ints = dict(M=51, S=51, K=1024, H=8, HKV=1, N=1024, XH=8, eps=1e-6, sxm=1024, swn=1024, scm=256, skb=159744,
                skh=159744, skn=256, svb=159744, svh=159744, svn=256, srm=1024, som=1024)
    tiles = dict(BM=64, BN=16, BK=128)
    found = {
        "qkv": identify_mutated_tensors(kernels._qkv_kernel, args(kernels._qkv_kernel, **ints, **tiles, D=256,
                                                                 HALF=128, ADA=True), {}),
        "gate_up": identify_mutated_tensors(kernels._gate_up_kernel, args(kernels._gate_up_kernel, **ints, **tiles,
                                                                          ADA=True), {}),
        "residual": identify_mutated_tensors(kernels._residual_kernel, args(kernels._residual_kernel, **ints, **tiles,
                                                                            XD=256, GATED=True), {})}
    assert found == {"qkv": ["Q", "Kb", "Vb"], "gate_up": ["Out"], "residual": ["Out"]}, found

    import torch._inductor.fx_passes.post_grad as post_grad

    from agents.policies.pi0.fast_attention import stacked_heads

    graphs, reinplace = [], post_grad.reinplace_inplaceable_ops

    class Seen(Exception):
        pass

    def after_reinplace(*args, **kw):  # the graph as inductor will lower it, then stop (no GPU to run it)
        reinplace(*args, **kw)
        graphs.append(args[-1])
        raise Seen()

    post_grad.reinplace_inplaceable_ops = after_reinplace

    def layer_step(x, w_qkv, w_o, w_gu, w_d, cos, sin, kb, vb, mask):
        q = kernels.qkv_rope(x, w_qkv, cos, sin, kb, vb, 51, 8, 1e-6)
        x = kernels.linear_residual(stacked_heads(q, kb, vb, mask, 0.0625), w_o, x)
        return kernels.linear_residual(kernels.gate_up(x, w_gu, 1e-6), w_d, x)

    def r(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    args = (r(51, 1024), r(2560, 1024), r(1024, 2048), r(8192, 1024), r(1024, 4096), r(51, 256), r(51, 256),
            r(1, 1, 624, 256), r(1, 1, 624, 256), r(1, 1, 51, 624))
    try:
        torch.compile(layer_step, dynamic=False)(*args)
    except Exception as e:  # the stop above, wrapped by inductor
        assert "Seen" in repr(e) or isinstance(e, Seen), e
    g = graphs[0].graph if hasattr(graphs[0], "graph") else graphs[0]
    calls = [str(n.target) for n in g.nodes if n.op == "call_function"]
    assert sum("triton_kernel_wrapper" in c for c in calls) == 4, calls
    assert not [c for c in calls if "copy" in c or "clone" in c], calls
    print("mutations ok")


def compile_checks(root: str, variant: str) -> None:
    """Run in a subprocess (:func:`hopper_driver`, the kernels' availability forced on): the fast
    path's compiled denoising step with the step layers, traced by dynamo with the batch symbolic
    and taken through inductor's post-grad passes (stopped there: no GPU to run it)."""
    hopper_driver()
    sys.path.insert(0, str(Path(__file__).parent))
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.post_grad as post_grad

    from agents.policies.pi0 import fast_step_kernels
    from agents.policies.pi0.fast import FastPiSampler
    from test_pi0_fast import CHUNK, SPEC, make
    from tools.make_tiny_checkpoints import make_pi0

    inductor_config.fx_graph_cache = False  # every graph through the passes, none from a cache
    fast_step_kernels.available = lambda device: True
    graphs, reinplace = [], post_grad.reinplace_inplaceable_ops

    class Seen(Exception):
        pass

    def after_reinplace(*args, **kw):
        reinplace(*args, **kw)
        graphs.append(args[-1].graph if hasattr(args[-1], "graph") else args[-1])
        raise Seen()

    post_grad.reinplace_inplaceable_ops = after_reinplace
    p = make(make_pi0(Path(root) / variant, SPEC, variant=variant, chunk_size=CHUNK), variant, fast_serving="eager",
             device="cpu")
    fast = p._fast = FastPiSampler(p.inner.model, p.variant, graphs=False, compile="dynamic", step_kv=True,
                                   step_layers="triton")
    fast._embed_image, fast._prefix_kv = p.inner.model.paligemma_with_expert.embed_image, fast.prefix_kv  # eager
    try:
        with torch.no_grad():
            p.forward_model(p.model_inputs(obs()), noise_for(p))
    except Exception as e:  # the stop above, wrapped by inductor
        assert "Seen" in repr(e), e
    g, = graphs
    calls = [n for n in g.nodes if n.op == "call_function"]
    layers = p.inner.model.paligemma_with_expert.gemma_expert.model.config.num_hidden_layers
    assert sum("triton_kernel_wrapper" in str(n.target) for n in calls) == 4 * layers
    assert not [n for n in calls if "copy_" in str(n.target)]  # nothing copied back into an input
    inputs_cloned = [n for n in calls if "clone" in str(n.target) and n.args[0].op == "placeholder"]
    assert not inputs_cloned, inputs_cloned
    print("compile ok")


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_the_compiled_steps_run_the_kernels_in_place(tmp_path, variant):
    """The compiled denoising step with the step layers (dynamo with the batch symbolic, then
    inductor's passes up to its reinplacing; the GPU test runs it): four kernels per expert
    layer, and the step buffers written in place (no input copied back, none cloned)."""
    code = f"import test_pi0_step_layers as t; t.compile_checks({str(tmp_path)!r}, {variant!r})"
    assert "compile ok" in python_code(code, timeout=600, triton_interpret=False)


def test_inductor_sees_what_each_kernel_writes():
    """Compiled, inductor treats each tensor a user kernel may write as written (a copy where it
    cannot write in place); where its analysis cannot follow a store to an argument it assumes
    every argument, the stacked weights included (megabytes a layer and step). Each kernel's
    stores lead to its outputs only (q and the two step buffers, or its one output), and a
    compiled layer-step's graph, after inductor's reinplacing, writes the buffers in place: no
    copy or clone left."""
    out = python_code("import test_pi0_step_layers as t; t.mutation_checks()", timeout=300, triton_interpret=False)
    assert "mutations ok" in out


def test_the_policy_setting(ckpts):  # noqa: F811
    """``policy.fast_step_layers``: off by default (config and shipped YAML); true builds the fast
    path with the step layers (on this CPU without the interpreter they run as they are: the same
    actions); with the step buffers off, or with the FP8 expert, it is refused naming the setting."""
    import yaml

    from agents.policies.pi0.config import Pi0PolicyConfig
    from agents.policies.pi0.fast_levers import lever_settings
    from test_pi0_step_kv import policy

    assert Pi0PolicyConfig().fast_step_layers is False
    for name in ("pi0", "pi05"):
        assert yaml.safe_load(open(f"config/policy/{name}.yaml"))["fast_step_layers"] is False
    assert lever_settings(Pi0PolicyConfig(), cuda=True)["step_layers"] == "default"
    assert lever_settings(Pi0PolicyConfig(fast_step_layers=True), cuda=True)["step_layers"] == "triton"
    for bad in (dict(fast_step_layers=True, fast_step_kv=False), dict(fast_step_layers="maybe"),
                dict(fast_step_layers=True, fast_step_kv=True, fast_expert_fp8=True)):
        with pytest.raises(ValueError, match="policy.fast_step_layers"):
            Pi0PolicyConfig(**bad).validate()
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    outs, noise = [], None
    for on in (False, True):
        p = policy(ckpts, "pi0", fast_step_kv=True, fast_step_layers=on).eval()
        noise = noise_for(p) if noise is None else noise
        with torch.no_grad():
            assert (p._fast_sampler().step_layers is not None) is on
            outs.append(p.act(obs(), deterministic=True, noise=noise).actions)
    torch.testing.assert_close(outs[0], outs[1], **CPU_TOL)
