"""PI0 / PI0.5 serving latency: the fast path (agents/policies/pi0_fast.py: CUDA graphs over
lerobot's modules) against lerobot's own paths, in one run on one GPU, full size, random bf16
weights, 2 cameras at 224, 10 flow steps, LoRA rank 16 folded for serving.

Per variant:
- ``fast_act_ms``: ``policy.act(obs)`` on the fast path (observation mapping included);
- ``fast_forward_ms``: the model call alone, batch 1, and ``fast_forward_by_batch`` at 4 and 8;
- ``eager_forward_ms``: the same call through lerobot's ``PI0Pytorch.sample_actions``;
- ``lerobot_select_action_ms`` (PI0): lerobot's ``PI0Policy.select_action`` (queue reset every
  call) on the same inputs, built without LoRA; ``speedup_vs_select_action`` = its p50 / ours;
- with ``--compile``: ``compiled_forward_ms``, ``compiled_act_ms`` and
  ``compiled_speedup_vs_select_action`` (``policy.fast_compile=true``);
- ``max_abs_diff``: fast vs eager actions on the same noise (bf16 tolerance).

Each timing runs at least ``--iters`` calls and then more until the 95% interval of the median
(order statistics) is within +-5% of it, or ``--max-iters``; the interval is printed, with a
warning when it stays wide. GPU clocks and other processes on the GPU are recorded.

    python -m tools.bench.pi0_fast --json out.json [--variants pi0,pi05]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def timed(fn, sync, iters: int, max_iters: int) -> dict:
    """p50/p99 with the 95% interval of the median (tools/bench/common.py), ``wide`` when it
    stays wider than +-5% after ``max_iters`` calls."""
    from tools.bench.common import p50_p99, timed_ms

    out = p50_p99(timed_ms(fn, iters, 5, sync, max_iters=max_iters))
    out["wide"] = not out.get("stable", True)
    return out


def bench_variant(variant: str, args, tmp: Path) -> dict:
    import torch

    from agents.policies.pi0 import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
    from tools.bench.common import bench_spec, gpu_state, random_obs
    from tools.bench.policy import lerobot_baseline
    from tools.make_tiny_checkpoints import build_tokenizer, make_pi0

    spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size if not args.tiny else 48, has_task=True)
    cls, cfg_cls = (Pi0Policy, Pi0PolicyConfig) if variant == "pi0" else (Pi05Policy, Pi05PolicyConfig)
    if args.tiny:
        cfg = cfg_cls(checkpoint=str(make_pi0(tmp / variant, spec, variant=variant)), chunk_size=8,
                      device=args.device, lora_rank=4)
    else:
        cfg = cfg_cls(tokenizer=str(build_tokenizer(tmp / f"{variant}_tok", kind="gemma")), device=args.device)
    policy = cls(cfg, spec).eval()
    cuda = policy.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    obs = {k: torch.from_numpy(v) for k, v in random_obs(spec.state_dim, spec.cameras).items()}
    obs["task"] = ["pick up the black bowl between the plate and the ramekin and place it on the plate"]
    res: dict = {"variant": variant, "gpu_before": gpu_state() if cuda else None}
    d = int(policy.lr_cfg.max_action_dim)
    it, mx = args.iters, args.max_iters

    def forward(inputs, noise):
        return lambda: policy.forward_model(inputs, noise)

    with torch.inference_mode():
        inputs = policy.model_inputs(obs)
        noise = torch.randn(1, policy.chunk_size, d, device=policy.device)
        t0 = time.perf_counter()
        fast = policy.forward_model(inputs, noise)
        sync()
        res["first_call_s"] = time.perf_counter() - t0  # includes warm-up + capture
        res["fast_forward_ms"] = timed(forward(inputs, noise), sync, it, mx)
        res["fast_act_ms"] = timed(lambda: policy.act(obs), sync, it, mx)
        by_batch = {}
        for b in (4, 8):
            ob = {k: (v * b if isinstance(v, list) else v.repeat(b, *([1] * (v.dim() - 1)))) for k, v in obs.items()}
            ib = policy.model_inputs(ob)
            nb = torch.randn(b, policy.chunk_size, d, device=policy.device)
            by_batch[b] = timed(forward(ib, nb), sync, max(20, it // 4), max(40, mx // 4))
        res["fast_forward_by_batch"] = by_batch
        if args.compile:  # the same graphs with a torch.compile'd denoising step
            captures = policy._fast.captures
            policy._fast, policy.cfg.fast_compile = None, True
            try:
                t0 = time.perf_counter()
                comp = policy.forward_model(inputs, noise)
                sync()
                res["compiled_first_call_s"] = time.perf_counter() - t0
                res["compiled_forward_ms"] = timed(forward(inputs, noise), sync, it, mx)
                res["compiled_act_ms"] = timed(lambda: policy.act(obs), sync, it, mx)
                res["compiled_max_abs_diff_vs_fast"] = float((comp - fast).abs().max())
            except Exception as exc:  # noqa: BLE001 - recorded: compile support varies
                res["compiled_error"] = f"{type(exc).__name__}: {exc}"[:500]
            policy._fast, policy.cfg.fast_compile = None, False
            policy.forward_model(inputs, noise)
            policy._fast.captures += captures
        policy.cfg.fast_serving = "off"
        eager = policy.forward_model(inputs, noise)
        res["max_abs_diff"] = float((fast - eager).abs().max())
        res["eager_abs_max"] = float(eager.abs().max())
        res["eager_forward_ms"] = timed(forward(inputs, noise), sync, max(20, it // 4), max(40, mx // 4))
        policy.cfg.fast_serving = "auto"
    res["captures"] = policy._fast.captures if getattr(policy, "_fast", None) else 0
    if variant == "pi0" and not args.no_baseline:
        ns = argparse.Namespace(iters=max(20, it // 4), warmup=3, max_iters=max(40, mx // 4), max_seconds=120.0)
        res["lerobot_select_action_ms"] = lerobot_baseline(policy, obs, ns, sync)
        res["speedup_vs_select_action"] = res["lerobot_select_action_ms"]["p50"] / res["fast_act_ms"]["p50"]
        if "compiled_act_ms" in res:
            res["compiled_speedup_vs_select_action"] = (res["lerobot_select_action_ms"]["p50"]
                                                        / res["compiled_act_ms"]["p50"])
    res["speedup_vs_eager_forward"] = res["eager_forward_ms"]["p50"] / res["fast_forward_ms"]["p50"]
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["gpu_after"] = gpu_state()
        res["device_name"] = torch.cuda.get_device_name()
    del policy
    if cuda:
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="pi0,pi05")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoints (CPU smoke test)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--max-iters", type=int, default=400)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd denoising step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants.split(","):
            r = bench_variant(v, args, Path(tmp))
            out[v] = r
            print(f"{v}: fast act p50 {r['fast_act_ms']['p50']:.2f} ms (95% CI {r['fast_act_ms']['ci95']}, p99 {r['fast_act_ms']['p99']:.2f}, n {r['fast_act_ms']['n']}); "
                  f"forward p50 {r['fast_forward_ms']['p50']:.2f} ms vs lerobot sample_actions "
                  f"{r['eager_forward_ms']['p50']:.2f} ms ({r['speedup_vs_eager_forward']:.1f}x); "
                  f"max |fast-eager| {r['max_abs_diff']:.3g}", flush=True)
            if "compiled_forward_ms" in r:
                print(f"  compiled: forward p50 {r['compiled_forward_ms']['p50']:.2f} ms, act p50 "
                      f"{r['compiled_act_ms']['p50']:.2f} / p99 {r['compiled_act_ms']['p99']:.2f} ms (first call "
                      f"{r['compiled_first_call_s']:.0f} s), max |diff| {r['compiled_max_abs_diff_vs_fast']:.3g}")
            elif "compiled_error" in r:
                print(f"  compile failed: {r['compiled_error']}")
            for b, t in r["fast_forward_by_batch"].items():
                print(f"  batch {b}: forward p50 {t['p50']:.2f} ms", flush=True)
            if "lerobot_select_action_ms" in r:
                print(f"  lerobot select_action p50 {r['lerobot_select_action_ms']['p50']:.2f} ms: "
                      f"{r['speedup_vs_select_action']:.1f}x"
                      + (f", compiled {r['compiled_speedup_vs_select_action']:.1f}x"
                         if "compiled_speedup_vs_select_action" in r else ""), flush=True)
            for k in ("fast_act_ms", "fast_forward_ms", "eager_forward_ms"):
                if r[k]["wide"]:
                    print(f"  WARNING: {k}: the 95% interval of the median is wider than +-5%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
