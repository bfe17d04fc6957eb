"""PI0 / PI0.5 serving latency: the fast path (agents/policies/pi0/fast.py: CUDA graphs over
lerobot's modules, torch.compile'd inside them by default on a GPU) against lerobot's own paths,
in one run on one GPU, full size, random bf16 weights, 2 cameras at 224, 10 flow steps, LoRA
rank 16 folded for serving.

Per variant and per compile mode in ``--modes`` (``dynamic``: the default, one compile for every
batch >= 2; ``static``: one compile per batch size; ``off``: graphs without torch.compile):
- ``warmup_s``: ``policy.warm_up`` per bucket of ``--warmup-buckets`` (compile + capture, in
  order), with ``warmup_compiled_graphs`` (graphs dynamo compiled for that bucket);
- ``act_ms``: ``policy.act(obs)`` at batch 1 (observation mapping included), after warm-up;
- ``forward_ms``: the model call alone at batch 1, and ``forward_by_batch`` at 4 and 8;
- ``max_abs_diff``: against lerobot's ``sample_actions`` on the same noise (bf16 tolerance).
Once per variant: ``eager_forward_ms`` (lerobot's ``PI0Pytorch.sample_actions``) and, for PI0,
``lerobot_select_action_ms`` (lerobot's ``PI0Policy.select_action``, queue reset every call, on
the same inputs, built without LoRA) with ``speedup_vs_select_action`` per mode (its p50 / the
mode's act p50).

``--rtc``: also real-time chunking (agents/policies/pi0/rtc.py) on the same fast path, per mode:
``rtc_capture_s`` (the first RTC call: its graph's capture), ``rtc_act_ms`` (batch 1, delay 5 of
a pending 25 or the chunk's half), ``rtc_forward_by_batch`` (4 and 8 rows of mixed delays, one
row without RTC) and ``rtc_overhead`` (rtc act p50 / act p50).

``--warmup-only``: the warm-up timings and a short act timing, nothing else (run it a second
time with the same ``--cache-dir`` to time a restart on a warm inductor cache).

``--levers``: the levers of the fast path (agents/policies/pi0/fast_levers.py, fast_fused.py) side
by side, each under every mode, in the same run on the same inputs and noise: ``baseline`` (every
lever off: SigLIP in float32 as lerobot holds it, the unfused layers), ``default`` (the policy's
defaults: on a GPU bf16 SigLIP, every layer's projections fused and the steps' keys/values in
per-call buffers), ``no_step_kv`` (the defaults without the buffers: ``default`` before
2026-11-29's afternoon, and the ``default`` of the levers' names below), ``bf16_vision``
(``policy.fast_vision_dtype=bf16``), ``bf16_vision_fp8`` (plus ``policy.fast_expert_fp8=true``),
``fp8`` (FP8 alone), ``bf16_vision_fused_expert`` / ``bf16_vision_fused`` (``policy.fast_fuse_proj``
expert / all), ``bf16_vision_autotune`` / ``bf16_vision_fused_autotune`` (``policy.fast_autotune``),
``default_step_kv`` (the defaults with the steps' keys/values in per-call buffers,
``policy.fast_step_kv=true``), ``default_flex`` / ``default_step_kv_flex`` (the steps'
attention through FlexAttention, ``step_attention="flex"``), ``default_triton`` /
``default_step_kv_triton`` (Triton kernels, agents/policies/pi0/fast_triton.py),
``default_cudnn_prefix`` / ``default_step_kv_cudnn_prefix`` (the prefix pass's attention, and
SigLIP's in passes of 4+ images, as cuDNN's fused attention op, ``prefix_attention="cudnn"``),
``default_combo`` / ``default_cdt`` / ``default_pdl`` (the defaults compiled with inductor's
combo kernels, which launch independent small kernels as one; with coordinate-descent tuning of
the Triton kernels' configs; or with programmatic dependent launch, a Triton kernel starting
while the one before it finishes, on Hopper; ``inductor=`` options), ``default_step_layers`` (the
expert's decoder layers in the steps as Triton kernels, agents/policies/pi0/fast_step_layers.py,
``step_layers="triton"``; ``default_step_layers_b1`` for calls of one observation only, larger
batches as the default; ``default_step_layers_cudnn_prefix`` with cuDNN's prefix attention too),
``default_fuse_vision`` (SigLIP's q/k/v as one GEMM per layer, ``fuse_vision=True``);
step_attention, prefix_attention, inductor and step_layers are sampler
arguments, not policy settings). A lever's results sit under
``modes["<mode>+<lever>"]`` (the baseline under ``modes["<mode>"]``) with ``act_ms``,
``forward_ms``, ``max_abs_diff`` (against lerobot's float32-SigLIP bf16 ``sample_actions``) and
``max_abs_diff_vs_baseline`` (against the same mode's baseline: the lever's own change).
``--peak`` adds each run's achieved TFLOP/s per batch and its share of the bf16 matmul peak
timed in the same run (FLOPs counted once per batch size on the computation without graphs).
``--profile`` adds each run's kernel profile (GPU time by kind of kernel, kernels per call) at
batch 1 and the last of ``--batches``. ``--batches ""`` skips the batch 4 / 8 timings (each new batch shape of a compiled mode costs a
compile); ``--deadline-s`` skips the (mode, lever) runs that would start too late to finish
(recorded as skipped; the JSON is written after every run).

Each timing runs at least ``--iters`` calls and then more until the 95% interval of the median
(order statistics) is within +-5% of it, or ``--max-iters``; the interval is printed, with a
warning when it stays wide. GPU clocks and other processes on the GPU are recorded.

    python -m tools.bench.pi0_fast --json out.json [--variants pi0,pi05] [--modes dynamic,static]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path


def error_text(exc: BaseException, head: int = 300, tail: int = 1500) -> str:
    """An exception for the JSON: its start and its end (an inductor error wraps its cause, the
    subprocess's traceback, and says what went wrong last)."""
    msg = f"{type(exc).__name__}: {exc}"
    return msg if len(msg) <= head + tail else f"{msg[:head]} [...] {msg[-tail:]}"


def timed(fn, sync, iters: int, max_iters: int) -> dict:
    """p50/p99 with the 95% interval of the median (tools/bench/common.py), ``wide`` when it
    stays wider than +-5% after ``max_iters`` calls."""
    from tools.bench.common import p50_p99, timed_ms

    out = p50_p99(timed_ms(fn, iters, 5, sync, max_iters=max_iters))
    out["wide"] = not out.get("stable", True)
    return out


def batch_of(obs: dict, b: int) -> dict:
    return {k: (v * b if isinstance(v, list) else v.repeat(b, *([1] * (v.dim() - 1)))) for k, v in obs.items()}


_DEFAULT = {"vision_dtype": "auto", "fuse_proj": "auto", "step_kv": True}  # the policy's defaults
_NO_KV = {"vision_dtype": "auto", "fuse_proj": "auto"}  # the defaults before the step buffers
#: --levers: name -> the lever's settings (policy.fast_* without the prefix; unnamed ones off: fp32 SigLIP,
#: no FP8, no fusion, no autotune, no step buffers) and the sampler arguments step_attention,
#: prefix_attention, inductor, step_layers
LEVERS = {"baseline": {}, "default": _DEFAULT, "no_step_kv": _NO_KV, "bf16_vision": {"vision_dtype": "bf16"},
          "bf16_vision_fp8": {"vision_dtype": "bf16", "expert_fp8": "true"}, "fp8": {"expert_fp8": "true"},
          "bf16_vision_fused_expert": {"vision_dtype": "bf16", "fuse_proj": "expert"},
          "bf16_vision_fused": {"vision_dtype": "bf16", "fuse_proj": "all"},
          "bf16_vision_autotune": {"vision_dtype": "bf16", "autotune": "true"},
          "bf16_vision_fused_autotune": {"vision_dtype": "bf16", "fuse_proj": "all", "autotune": "true"},
          # the names below were given when "default" had no buffers: default_X is no_step_kv + X
          "default_step_kv": _DEFAULT,
          "default_flex": {**_NO_KV, "step_attention": "flex"},
          "default_step_kv_flex": {**_DEFAULT, "step_attention": "flex"},
          "default_triton": {**_NO_KV, "step_attention": "triton"},
          "default_step_kv_triton": {**_DEFAULT, "step_attention": "triton"},
          "default_cudnn_prefix": {**_NO_KV, "prefix_attention": "cudnn"},
          "default_step_kv_cudnn_prefix": {**_DEFAULT, "prefix_attention": "cudnn"},
          "default_combo": {**_DEFAULT, "inductor": {"combo_kernels": True}},
          "default_cdt": {**_DEFAULT, "inductor": {"coordinate_descent_tuning": True}},
          "default_pdl": {**_DEFAULT, "inductor": {"triton.enable_pdl": True}},
          "default_step_layers": {**_DEFAULT, "step_layers": "triton"},
          "default_step_layers_b1": {**_DEFAULT, "step_layers": "triton", "step_layers_max_rows": 64},
          "default_fuse_vision": {**_DEFAULT, "fuse_vision": True},
          "default_step_layers_cudnn_prefix": {**_DEFAULT, "step_layers": "triton", "prefix_attention": "cudnn"}}


def lever_kwargs(lever: str, device) -> dict:
    from types import SimpleNamespace

    from agents.policies.pi0.fast_levers import lever_settings

    s = {"vision_dtype": "fp32", "expert_fp8": False, "fuse_proj": "off", "autotune": False, **LEVERS[lever]}
    # step_kv is policy.fast_step_kv; step_attention a sampler argument (agents/policies/pi0/fast_attention.py)
    sampler = {"step_kv": s.pop("step_kv", False), "step_attention": s.pop("step_attention", "mqa"),
               "prefix_attention": s.pop("prefix_attention", "default"), "inductor": s.pop("inductor", None),
               "step_layers": s.pop("step_layers", "default"),
               "step_layers_max_rows": s.pop("step_layers_max_rows", None), "fuse_vision": s.pop("fuse_vision", False)}
    kw = lever_settings(SimpleNamespace(**{f"fast_{k}": v for k, v in s.items()}),
                        getattr(device, "type", device) == "cuda")
    if kw["expert_fp8"] == "cuda" and getattr(device, "type", device) != "cuda":
        kw["expert_fp8"] = "emulate"  # a CPU smoke run: the same quantization, float32 matmuls
    return {**kw, **sampler}


def bench_mode(policy, mode: str, obs, inputs, noise, args, sync, lever: str = "baseline") -> dict:
    import torch

    from agents.policies.pi0.fast import FastPiSampler

    policy._fast = None
    torch.cuda.empty_cache() if policy.device.type == "cuda" else None
    kw = lever_kwargs(lever, policy.device)
    policy._fast = fast = FastPiSampler(policy.inner.model, policy.variant, graphs=policy.device.type == "cuda",
                                        compile=None if mode == "off" else mode, **kw)
    res: dict = {"mode": mode, "lever": lever, "vision_dtype": str(kw["vision_dtype"]),
                 "expert_fp8": kw["expert_fp8"], "fuse_proj": kw["fuse"], "autotune": kw["autotune"], "step_kv": kw["step_kv"],
                 "step_attention": kw["step_attention"], "prefix_attention": kw["prefix_attention"],
                 "inductor": kw["inductor"], "step_layers": kw["step_layers"], "warmup_s": {}, "warmup_compiled_graphs": {}}
    if fast.levers is not None and fast.levers.fp8 is not None:
        res["fp8_layers"], res["fp8_skipped"] = len(fast.levers.fp8.sites), fast.levers.fp8.skipped
    for b in args.warmup_buckets:
        compiles = fast.compiles
        res["warmup_s"].update(policy.warm_up([b]))
        res["warmup_compiled_graphs"][b] = fast.compiles - compiles
    res["warmup_total_s"] = sum(res["warmup_s"].values())
    it, mx = (20, 60) if args.warmup_only else (args.iters, args.max_iters)
    with torch.inference_mode():
        res["act_ms"] = timed(lambda: policy.act(obs), sync, it, mx)
        if args.warmup_only:
            return res
        res["forward_ms"] = timed(lambda: policy.forward_model(inputs, noise), sync, it, mx)
        res["out"] = policy.forward_model(inputs, noise)
        by_batch = {}
        for b in args.batches:
            ib = policy.model_inputs(batch_of(obs, b))
            nb = torch.randn(b, *noise.shape[1:], device=noise.device)
            by_batch[b] = timed(lambda: policy.forward_model(ib, nb), sync, max(20, it // 4), max(40, mx // 4))
        res["forward_by_batch"] = by_batch
        if args.rtc:
            res.update(bench_rtc(policy, obs, noise, sync, it, mx, res["act_ms"], args.batches))
    if args.profile and policy.device.type == "cuda":
        res["profile"] = profile_sampler(policy, fast, obs, [1, *args.batches[-1:]], noise.shape[1:], sync)
    res["captures"], res["compiled_graphs"] = fast.captures, fast.compiles
    return res


def count_flops(policy, obs, batches) -> dict:
    """{batch: FLOPs of one call} of the fast computation without graphs or compile
    (FlopCounterMode sees no kernels inside a graph; the levers do the same arithmetic)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from agents.policies.pi0.fast import FastPiSampler

    out = {}
    sampler = FastPiSampler(policy.inner.model, policy.variant, graphs=False)
    steps = int(policy.lr_cfg.num_inference_steps)
    with torch.inference_mode():
        for b in batches:
            images, img_masks, toks, masks, *rest = policy.model_inputs(batch_of(obs, b))
            noise = torch.randn(b, policy.chunk_size, int(policy.lr_cfg.max_action_dim), device=policy.device)
            with FlopCounterMode(display=False) as fc:
                sampler._sample(images, img_masks, toks, masks, rest[0] if rest else None, noise, steps)
            out[b] = float(fc.get_total_flops())
    return out


def share_of_peak(run: dict, res: dict) -> None:
    """Each timed batch's achieved TFLOP/s and its share of the run's bf16 matmul peak (with --peak)."""
    if "flops" not in res or "forward_ms" not in run:
        return
    peak = res["peak_matmul"]["tflops"]
    times = {1: run["forward_ms"], **run.get("forward_by_batch", {})}
    run["tflops"] = {b: res["flops"][b] / (t["p50"] / 1e3) / 1e12 for b, t in times.items() if b in res["flops"]}
    run["share_of_peak"] = {b: tf / peak for b, tf in run["tflops"].items()}


def profile_sampler(policy, fast, obs, batches, noise_shape, sync) -> dict:
    """Kernel profile (tools/bench/pi0_profile.py) of ``fast``'s computation without its graphs
    (the same compiled kernels, visible one by one), per batch size, in the capture's grad mode."""
    import torch

    from agents.policies.fast_common import static_shapes_only
    from tools.bench.pi0_profile import profile

    out = {}
    steps = int(policy.lr_cfg.num_inference_steps)
    with torch.inference_mode(False), torch.no_grad(), static_shapes_only():
        for b in batches:
            images, img_masks, toks, masks, *rest = policy.model_inputs(batch_of(obs, b))
            noise = torch.randn(b, *noise_shape, device=policy.device)
            fast.sync_weights()
            try:
                out[b] = profile(lambda: fast._sample(images, img_masks, toks, masks, rest[0] if rest else None,  # noqa: B023
                                                      noise, steps), sync)
            except Exception as exc:  # noqa: BLE001 - recorded; the timings stand
                out[b] = {"error": error_text(exc)}
    return out


def rtc_rows(policy, b: int):
    """``b`` RTC rows: delays 0..5 cycling, half the chunk pending, the last row without RTC."""
    import numpy as np

    from agents.policies.pi0.rtc import RtcRows, RtcSettings

    h, a = policy.chunk_size, policy.action_dim
    pending = np.full(b, max(1, h // 2), np.int64)
    delay = np.minimum(np.arange(b) % 6, pending)
    if b > 1:
        pending[-1] = delay[-1] = 0
    prefix = np.random.default_rng(0).uniform(-0.5, 0.5, (b, h, a)).astype(np.float32)
    return RtcRows(prefix, delay, pending, RtcSettings(enabled=True))


def bench_rtc(policy, obs, noise, sync, it: int, mx: int, act_ms: dict, batches: list[int]) -> dict:
    import torch

    one = rtc_rows(policy, 1)
    t0 = time.perf_counter()
    policy.act(obs, noise=noise, rtc=one)
    sync()
    res = {"rtc_capture_s": time.perf_counter() - t0,
           "rtc_act_ms": timed(lambda: policy.act(obs, noise=noise, rtc=one), sync, it, mx)}
    res["rtc_overhead"] = res["rtc_act_ms"]["p50"] / act_ms["p50"]
    by_batch = {}
    for b in batches:
        ob = batch_of(obs, b)
        nb = torch.randn(b, *noise.shape[1:], device=noise.device)
        rows = rtc_rows(policy, b)
        by_batch[b] = timed(lambda: policy.act(ob, noise=nb, rtc=rows), sync, max(20, it // 4), max(40, mx // 4))
    res["rtc_forward_by_batch"] = by_batch
    return res


def bench_variant(variant: str, args, tmp: Path, save=lambda res: None) -> dict:
    import torch

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
    from tools.bench.common import bench_spec, gpu_state, random_obs
    from tools.bench.policy import lerobot_baseline
    from tools.make_tiny_checkpoints import build_tokenizer, make_pi0

    spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size if not args.tiny else 48, has_task=True)
    cls, cfg_cls = (Pi0Policy, Pi0PolicyConfig) if variant == "pi0" else (Pi05Policy, Pi05PolicyConfig)
    t0 = time.perf_counter()
    if args.tiny:
        cfg = cfg_cls(checkpoint=str(make_pi0(tmp / variant, spec, variant=variant)), chunk_size=8,
                      device=args.device, lora_rank=4)
    else:
        cfg = cfg_cls(tokenizer=str(build_tokenizer(tmp / f"{variant}_tok", kind="gemma")), device=args.device)
    if str(args.device).startswith("cpu"):
        cfg.fast_serving = "eager"  # a CPU smoke run times the fast computation (auto: lerobot's on a CPU)
    policy = cls(cfg, spec).eval()
    cuda = policy.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    obs = {k: torch.from_numpy(v) for k, v in random_obs(spec.state_dim, spec.cameras).items()}
    obs["task"] = ["pick up the black bowl between the plate and the ramekin and place it on the plate"]
    res: dict = {"variant": variant, "build_s": time.perf_counter() - t0, "gpu_before": gpu_state() if cuda else None,
                 "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "modes": {}}
    d = int(policy.lr_cfg.max_action_dim)
    with torch.inference_mode():
        inputs = policy.model_inputs(obs)
        noise = torch.randn(1, policy.chunk_size, d, device=policy.device)
    if args.peak and cuda:  # FLOPs of a call per batch (the fast computation eagerly), the bf16 matmul peak
        from tools.bench.common import matmul_peak

        res["peak_matmul"] = matmul_peak(args.device, 8192)
        res["flops"] = count_flops(policy, obs, [1, *args.batches])
    eager = None
    if not args.warmup_only:  # lerobot's actions first: each run's differences are saved with it
        with torch.inference_mode():
            policy.cfg.fast_serving, serving = "off", policy.cfg.fast_serving
            eager = policy.forward_model(inputs, noise)
            policy.cfg.fast_serving = serving
        res["eager_abs_max"] = float(eager.abs().max())
    outs = {}
    for mode in args.modes:
        for lever in args.levers:
            key = mode if lever == "baseline" else f"{mode}+{lever}"
            need = 30.0 if mode == "off" else 100.0  # a run's time at batch 1, a cold compile's included
            if args.deadline_s and time.perf_counter() - args.t0 + need > args.deadline_s:
                res["modes"][key] = {"skipped": f"deadline: {args.deadline_s:.0f} s"}
                continue
            try:
                res["modes"][key] = r = bench_mode(policy, mode, obs, inputs, noise, args, sync, lever)
                if "out" in r:
                    outs[key] = out = r.pop("out")
                    r["max_abs_diff"] = float((out - eager).abs().max())
                    if lever != "baseline" and mode in outs:
                        r["max_abs_diff_vs_baseline"] = float((out - outs[mode]).abs().max())
                share_of_peak(r, res)
                print(f"[pi0_fast] {variant} {key}: act p50 {r['act_ms']['p50']:.2f} ms p99 {r['act_ms']['p99']:.2f}, "
                      f"max |fast-lerobot| {r.get('max_abs_diff', float('nan')):.3g}", flush=True)
            except Exception as exc:  # noqa: BLE001 - recorded: compile / FP8 support varies
                res["modes"][key] = {"error": error_text(exc)}
                print(f"[pi0_fast] {variant} {key}: {res['modes'][key]['error'][:300]}", flush=True)
                traceback.print_exc()  # the whole of it in the log: compile errors end with their cause
            save(res)
    policy._fast = None
    late = args.deadline_s and time.perf_counter() - args.t0 + 15.0 > args.deadline_s
    if not args.warmup_only and not late:
        with torch.inference_mode():
            policy.cfg.fast_serving, serving = "off", policy.cfg.fast_serving
            res["eager_forward_ms"] = timed(lambda: policy.forward_model(inputs, noise), sync, 20, 40)
            policy.cfg.fast_serving = serving
        if variant == "pi0" and not args.no_baseline:
            ns = argparse.Namespace(iters=20, warmup=3, max_iters=40, max_seconds=120.0)
            res["lerobot_select_action_ms"] = base = lerobot_baseline(policy, obs, ns, sync)
            for r in res["modes"].values():
                if "act_ms" in r:
                    r["speedup_vs_select_action"] = base["p50"] / r["act_ms"]["p50"]
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["gpu_after"] = gpu_state()
        res["device_name"] = torch.cuda.get_device_name()
    del policy
    if cuda:
        torch.cuda.empty_cache()
    return res


def report(v: str, r: dict) -> None:
    print(f"{v} on {r.get('device_name', 'cpu')} (model built in {r['build_s']:.0f} s, inductor cache "
          f"{r['inductor_cache']}):", flush=True)
    for mode, m in r["modes"].items():
        if "error" in m or "skipped" in m:
            print(f"  {mode}: {'FAILED ' + m['error'] if 'error' in m else 'SKIPPED ' + m['skipped']}", flush=True)
            continue
        warm = ", ".join(f"{b}: {s:.1f} s ({m['warmup_compiled_graphs'][b]} graphs)" for b, s in m["warmup_s"].items())
        print(f"  {mode}: warm-up {m['warmup_total_s']:.1f} s [{warm}]", flush=True)
        a = m["act_ms"]
        line = f"    act p50 {a['p50']:.2f} ms (95% CI {a.get('ci95')}, p99 {a['p99']:.2f}, n {a['n']})"
        if "forward_ms" in m:
            line += f"; forward p50 {m['forward_ms']['p50']:.2f} ms"
            if m["forward_by_batch"]:
                line += f", batch {' / '.join(map(str, m['forward_by_batch']))}: " + " / ".join(
                    f"{t['p50']:.2f}" for t in m["forward_by_batch"].values()) + " ms"
        if "max_abs_diff" in m:
            line += f"; max |fast-lerobot| {m['max_abs_diff']:.3g}"
        if "max_abs_diff_vs_baseline" in m:
            line += f" (vs the baseline {m['max_abs_diff_vs_baseline']:.3g})"
        if "speedup_vs_select_action" in m:
            line += f"; {m['speedup_vs_select_action']:.1f}x lerobot select_action"
        if "share_of_peak" in m:
            line += "; share of peak " + ", ".join(f"b{b} {x:.0%}" for b, x in m["share_of_peak"].items())
        print(line + (" (WARNING: wide interval)" if a["wide"] else ""), flush=True)
        if "rtc_act_ms" in m:
            print(f"    RTC: act p50 {m['rtc_act_ms']['p50']:.2f} ms ({m['rtc_overhead']:.2f}x plain act), capture "
                  f"{m['rtc_capture_s']:.1f} s, act batch {' / '.join(map(str, m['rtc_forward_by_batch']))} (mixed delays): " + " / ".join(
                      f"{t['p50']:.2f}" for t in m["rtc_forward_by_batch"].values()) + " ms", flush=True)
    if "eager_forward_ms" in r:
        print(f"  lerobot sample_actions p50 {r['eager_forward_ms']['p50']:.2f} ms", flush=True)
    if "lerobot_select_action_ms" in r:
        s = r["lerobot_select_action_ms"]
        print(f"  lerobot select_action p50 {s['p50']:.2f} ms (p99 {s['p99']:.2f})", flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="pi0,pi05")
    ap.add_argument("--modes", default="dynamic", help="comma list of dynamic, static, off")
    ap.add_argument("--warmup-buckets", default="1,2,4,8")
    ap.add_argument("--warmup-only", action="store_true", help="warm-up timings and a short act timing only")
    ap.add_argument("--cache-dir", default=None, help="TORCHINDUCTOR_CACHE_DIR for this run")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoints (CPU smoke test)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--max-iters", type=int, default=400)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # compiled is the default now
    ap.add_argument("--rtc", action="store_true", help="also time real-time chunking (per-row prefix and delay)")
    ap.add_argument("--levers", default="baseline", help=f"comma list of {', '.join(LEVERS)}")
    ap.add_argument("--batches", default="4,8", help='batch sizes timed beyond 1 ("": none)')
    ap.add_argument("--peak", action="store_true",
                    help="count FLOPs per call and time the bf16 matmul peak: TFLOP/s and share of peak per batch")
    ap.add_argument("--profile", action="store_true",
                    help="a kernel profile per run at batch 1 and the last of --batches (by kind, kernels per call)")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="skip runs that would end past this (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.warmup_buckets = [int(b) for b in args.warmup_buckets.split(",")]
    args.levers = [x.strip() for x in args.levers.split(",") if x.strip()]
    unknown = sorted(set(args.levers) - set(LEVERS))
    if unknown:
        ap.error(f"--levers: unknown {unknown}; valid: {list(LEVERS)}")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    args.t0 = time.perf_counter()
    out = {}

    def save(v, res):
        out[v] = res
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))

    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants.split(","):
            res = bench_variant(v, args, Path(tmp), lambda r, v=v: save(v, r))
            save(v, res)
            report(v, res)
    return out


if __name__ == "__main__":
    main()
