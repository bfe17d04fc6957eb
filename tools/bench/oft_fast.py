"""OpenVLA-OFT serving speed: the fast path (agents/policies/openvla_oft/fast.py: CUDA graphs over the
policy's modules) against the eager path, and the achieved fraction of the GPU's bf16 matmul
peak, in one run on one GPU. Full size (Llama-2-7B + fused DINOv2/SigLIP, 2 cameras at 224,
chunk 8 x 7, LoRA rank 32 folded for serving), random bf16 weights, small local tokenizer.

Figures, per head (``l1``, ``discrete``):
- ``peak_matmul_tflops``: ``torch.mm`` of two 8192^2 bf16 matrices, median of 10 after warm-up
  (measured once, first, in the same run);
- ``eager_act_ms`` / ``fast_act_ms``: ``policy.act(obs)`` at batch 1 with ``fast_serving`` off /
  auto (observation mapping included), p50/p99 with the 95% interval of the median
  (tools/bench/common.py), ``speedup``; ``first_call_s`` (warm-up + capture of batch 1);
  ``max_abs_diff`` fast vs eager actions (discrete: deterministic tokens' actions);
- ``by_batch``: for B in ``--batches`` (1, 2, 4, 8, 16): FLOPs of one call (FlopCounterMode on
  the ungraphed fast computation, counted once per B), ``act_ms`` (fast), achieved TFLOP/s =
  FLOPs / p50 and ``mfu`` = that / peak;
- ``actors``: with ``--actors`` (default 8), that many actor processes in a closed act loop
  through the learner's serving path (LearnerService + InferenceServer on loopback, the actor
  client; tools/bench/policy_actors.py), chunks/s, mean served batch, and achieved TFLOP/s /
  MFU counting each served chunk as FLOPs(B=1);
- the fast path compiles the LM layers by default on a GPU (``policy.fast_compile=auto``);
  ``--no-compile``: graphs alone; ``--compile``: also a second, freshly compiled instance
  (``compiled_act_ms``); ``--sdpa cudnn,efficient``: the decoder's SDPA backend order;
- with ``--profile``: the top CUDA kernels of 5 fast batch-1 calls (where the time goes);
- ``--levers default,fp8``: each head once per lever, built anew, in the same run: ``fp8`` serves
  with the Llama layers' linears in FP8 (``policy.fast_llm_fp8=true``; ``emulate`` with
  ``--tiny``), its results under ``heads["<head>+fp8"]`` (its ``max_abs_diff`` is then against the
  bf16 eager path: the quantization's effect; its MFU still divides by the bf16 peak).

Every section is guarded: an error is recorded under ``errors`` and the JSON is written anyway.

    python -m tools.bench.oft_fast --json out.json [--heads l1,discrete] [--actors 8]
    python -m tools.bench.oft_fast --tiny --json out.json     # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tools.bench.common import matmul_peak


def _timed(fn, sync, iters: int, max_iters: int, max_s: float, warmup: int = 3) -> dict:
    from tools.bench.common import ci_warning, p50_p99, timed_ms

    out = p50_p99(timed_ms(fn, iters, warmup, sync, max_iters=max_iters, max_s=max_s))
    out["warning"] = ci_warning("timing", out)
    return out


#: --levers: name -> policy settings (``emulate`` stands for FP8's ``true`` with --tiny on the CPU)
LEVERS = {"default": {}, "fp8": {"fast_llm_fp8": True}}


def lever_overrides(lever: str, tiny: bool) -> dict:
    return {k: ("emulate" if tiny and v is True and k.endswith("fp8") else v) for k, v in LEVERS[lever].items()}


def build(head: str, args, tmp: Path, spec):
    from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig
    from tools.make_tiny_checkpoints import build_tokenizer, make_openvla_oft

    cls, cfg_cls = ((OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig) if head == "l1" else
                    (OpenVLAOFTDiscretePolicy, OpenVLAOFTDiscretePolicyConfig))
    mode = "eager" if args.device == "cpu" else "auto"  # the CPU smoke test runs the fast computation
    if args.tiny:
        ck = tmp / "oft_tiny"
        if not ck.exists():
            make_openvla_oft(ck, spec)
        cfg = cfg_cls(checkpoint=str(ck), device=args.device, lora_rank=4, fast_serving=mode,
                      fast_compile=not args.no_compile and "auto", **getattr(args, "overrides", {}))
    else:
        tok = tmp / "oft_tok"
        if not tok.exists():
            build_tokenizer(tok, kind="llama", vocab_size=2000)
        cfg = cfg_cls(tokenizer=str(tok), device=args.device, fast_serving=mode, fast_compile=not args.no_compile and "auto",
                      **getattr(args, "overrides", {}))
    return cls(cfg, spec).eval()


def bench_head(head: str, args, tmp: Path, spec, peak: float | None, errors: list) -> dict:
    import torch

    from agents.policies.openvla_oft.fast import FastOFT
    from tools.bench.common import gpu_state, random_obs
    from tools.bench.policy_actors import TASK

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res: dict = {"head": head}
    t0 = time.perf_counter()
    policy = build(head, args, tmp, spec)
    res["build_s"] = time.perf_counter() - t0
    mode = policy.cfg.fast_serving
    res["gpu_before"] = gpu_state() if cuda else None

    def obs_of(b: int) -> dict:
        o = {k: torch.from_numpy(v) for k, v in random_obs(spec.state_dim, spec.cameras, n=b).items()}
        o["task"] = [TASK] * b
        return o

    def section(name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
            errors.append(f"{head} {name}: {type(exc).__name__}: {exc}"[:2000])
            print(f"  {head} {name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            traceback.print_exc()

    it, mx, ms = args.iters, args.max_iters, args.max_seconds
    o1 = obs_of(1)

    def latency():
        with torch.inference_mode():
            t0 = time.perf_counter()
            fast = policy.act(o1, deterministic=True)
            sync()
            res["first_call_s"] = time.perf_counter() - t0
            policy.cfg.fast_serving = "off"
            try:
                eager = policy.act(o1, deterministic=True)
                res["max_abs_diff"] = float((fast.actions - eager.actions).abs().max())
                res["eager_act_ms"] = _timed(lambda: policy.act(o1), sync, max(args.floor, it // 2), mx, ms,
                                             args.warmup)
            finally:
                policy.cfg.fast_serving = mode
            res["fast_act_ms"] = _timed(lambda: policy.act(o1), sync, it, mx, ms, args.warmup)
            res["speedup"] = res["eager_act_ms"]["p50"] / res["fast_act_ms"]["p50"]
    section("latency", latency)

    flops: dict[int, float] = {}

    def sweep():
        from torch.utils.flop_counter import FlopCounterMode

        by = {}
        for b in args.batches:
            ob = obs_of(b)
            with torch.inference_mode():
                inputs = policy.model_inputs(ob)
                with FlopCounterMode(display=False) as fc:
                    FastOFT(policy, graphs=False).run(inputs)
                flops[b] = float(fc.get_total_flops())
                t = _timed(lambda: policy.act(ob), sync, max(args.floor, it // 4), max(args.floor, mx // 4), ms / 2,
                           args.warmup)
            tflops = flops[b] / (t["p50"] / 1e3) / 1e12
            by[b] = {"flops": flops[b], "act_ms": t, "tflops": tflops, "mfu": tflops / peak if peak else None}
            print(f"  {head} batch {b:>2}: act p50 {t['p50']:.2f} ms, {flops[b] / 1e12:.2f} TFLOP/call, "
                  f"{tflops:.1f} TFLOP/s" + (f", MFU {tflops / peak:.1%}" if peak else ""), flush=True)
        res["by_batch"] = by
    section("batch sweep", sweep)
    fast_now = policy.__dict__.get("_fast")
    res["captures_after_sweep"] = fast_now.captures if fast_now is not None else 0

    def actors():
        res["actors"] = serve_actors(policy, spec, args, flops.get(1), peak)
    if args.actors > 0:
        section("actors", actors)

    def compiled():
        fast = policy.__dict__.get("_fast")
        try:
            with torch.inference_mode():
                policy.__dict__["_fast"] = FastOFT(policy, graphs=cuda, compile=True)
                t0 = time.perf_counter()
                a = policy.act(o1, deterministic=True)
                sync()
                res["compiled_first_call_s"] = time.perf_counter() - t0
                res["compiled_act_ms"] = _timed(lambda: policy.act(o1), sync, it, mx, ms)
                policy.__dict__["_fast"] = fast
                b = policy.act(o1, deterministic=True)
                res["compiled_max_abs_diff_vs_fast"] = float((a.actions - b.actions).abs().max())
        finally:
            policy.__dict__["_fast"] = fast
    if args.compile:
        section("compile", compiled)

    def profile():
        from torch.profiler import ProfilerActivity, profile as prof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.inference_mode(), prof(activities=acts) as p:
            for _ in range(5):
                policy.act(o1)
            sync()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        res["profile_top"] = p.key_averages().table(sort_by=key, row_limit=20)
        print(res["profile_top"], flush=True)
    if args.profile:
        section("profile", profile)
    if (fast_now := policy.__dict__.get("_fast")) is not None:  # graphs of the default path
        res["captures"], res["capture_s"] = fast_now.captures, fast_now.capture_s
        res["graphs_eager_fallback"] = cuda and not fast_now.graphs
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["gpu_after"] = gpu_state()
    del policy, fast_now
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def serve_actors(policy, spec, args, flops1: float | None, peak: float | None) -> dict:
    """``args.actors`` actor processes through a loopback learner (tools/bench/policy.py's setup)."""
    import torch

    from learner.weights import WeightPublisher
    from tools.bench.common import LoopbackLearner
    from tools.bench.policy_actors import HASH, run_actors

    learner = LoopbackLearner(policy, spec, HASH, buffer_capacity=8, device=torch.device(args.device),
                              get_version=lambda: pub.version, get_weights=lambda: pub.latest(),
                              service_kw={"peer_timeout_s": 600.0},
                              inference_kw={"max_batch": 64, "batch_window_ms": args.batch_window_ms})
    # a weights version through the serving path (loaded on the inference thread, into the
    # graphs' parameters in place), as the learner publishes them
    pub = WeightPublisher(learner.inference.set_weights, learner.service.publish)
    pub.publish(policy.trainable_state_dict(), version=1)
    learner.start()
    try:
        inf = learner.inference
        cams = {c: list(s) for c, s in spec.cameras.items()}
        r = run_actors(args.actors, learner.service.port, args.seconds, spec.state_dim, cams,
                       lambda: (inf.batches, inf.served))
    finally:
        learner.close()
    r["actions_per_s"] = r["chunks_per_s"] * policy.chunk_size
    if flops1:
        r["tflops"] = r["chunks_per_s"] * flops1 / 1e12
        r["mfu"] = r["tflops"] / peak if peak else None
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="l1,discrete")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on the CPU (smoke test)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--actors", type=int, default=None, help="concurrent actors (0: skip; default 8, tiny 0)")
    ap.add_argument("--seconds", type=float, default=10.0, help="actor run length")
    ap.add_argument("--batch-window-ms", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--max-iters", type=int, default=400)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--matmul-n", type=int, default=None, help="peak matmul size (default 8192, tiny 256)")
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd LM in the graphs")
    ap.add_argument("--sdpa", default=None, help="SDPA backend order for the decoder, e.g. cudnn,efficient")
    ap.add_argument("--no-compile", action="store_true", help="the default graphs without torch.compile")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of 5 fast batch-1 calls")
    ap.add_argument("--levers", default="default", help=f"comma list of {', '.join(LEVERS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    levers = [x for x in args.levers.split(",") if x]
    for lever in levers:
        if lever not in LEVERS:
            raise SystemExit(f"--levers: unknown lever {lever!r}; one of {', '.join(LEVERS)}")
    import torch

    from agents.policies.openvla_oft import fast as oft_fast

    if args.sdpa:
        oft_fast.SDPA_ORDER = tuple(x.strip() for x in args.sdpa.split(","))

    from tools.bench.common import bench_spec

    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.actors = (0 if args.tiny else 8) if args.actors is None else args.actors
    args.floor, args.warmup = 20, 3  # the fewest timed calls of a secondary figure; untimed calls first
    if args.tiny:  # a smoke test: every section runs, the figures mean nothing
        args.iters, args.max_iters, args.max_seconds = min(args.iters, 3), min(args.max_iters, 3), 1.0
        args.floor, args.warmup = 3, 1
    cuda = args.device.startswith("cuda")
    spec = bench_spec(8, 7, ["image", "wrist_image"], 32 if args.tiny else 224, has_task=True)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "tiny": args.tiny, "heads": {}, "errors": []}
    try:
        try:
            out["peak_matmul"] = matmul_peak(args.device, args.matmul_n or (256 if args.tiny else 8192))
            print(f"peak matmul: {out['peak_matmul']['tflops']:.1f} TFLOP/s ({out['peak_matmul']['dtype']}, "
                  f"n {out['peak_matmul']['n']})", flush=True)
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"peak matmul: {type(exc).__name__}: {exc}")
        peak = out.get("peak_matmul", {}).get("tflops")
        with tempfile.TemporaryDirectory() as tmp:
            for head, lever in [(h, lv) for h in args.heads.split(",") for lv in levers]:
                name = head if lever == "default" else f"{head}+{lever}"
                args.overrides = lever_overrides(lever, args.tiny)
                print(f"== {name} ({'tiny' if args.tiny else 'full size'}, {out['device']})", flush=True)
                try:
                    r = bench_head(head, args, Path(tmp), spec, peak, out["errors"])
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the model
                    out["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:2000])
                    traceback.print_exc()
                    continue
                out["heads"][name] = r
                print(summary(r), flush=True)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


def summary(r: dict) -> str:
    lines = []
    if "fast_act_ms" in r:
        f, e = r["fast_act_ms"], r["eager_act_ms"]
        lines.append(f"  act batch 1: fast p50 {f['p50']:.2f} ms (95% CI {f['ci95']}, p99 {f['p99']:.2f}, n {f['n']}) "
                     f"vs eager p50 {e['p50']:.2f} ms (p99 {e['p99']:.2f}): x{r['speedup']:.2f}; first call "
                     f"{r['first_call_s']:.1f} s; max |fast - eager| {r['max_abs_diff']:.3g}")
        for k in ("fast_act_ms", "eager_act_ms"):
            if r[k].get("warning"):
                lines.append(f"  WARNING {k}: {r[k]['warning']}")
    if "actors" in r:
        a = r["actors"]
        lines.append(f"  {a['actors']} actors: {a['chunks_per_s']:.1f} chunks/s, mean batch {a['mean_batch']:.1f}, "
                     f"p50 {a['lat_p50_ms']:.1f} ms" + (f", {a['tflops']:.1f} TFLOP/s" if a.get("tflops") else "")
                     + (f", MFU {a['mfu']:.1%}" if a.get("mfu") else ""))
    if "compiled_act_ms" in r:
        lines.append(f"  compiled: act p50 {r['compiled_act_ms']['p50']:.2f} ms (first call "
                     f"{r['compiled_first_call_s']:.0f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
