"""VLA serving benchmark: PI0 and OpenVLA-OFT behind Tandem's learner socket.

Self-contained: it builds the full-size models with random weights (bf16 on a GPU) from
configs, plus small local tokenizers; nothing is downloaded. Per policy, in one run:

- ``bare_forward_ms``: the model call alone on prepared tensors (PI0: lerobot's
  ``PI0Pytorch.sample_actions``, 10 flow steps; OFT: the VLA + action head), batch 1;
- ``act_ms``: ``policy.act(obs)`` for one observation (observation mapping included), and
  ``overhead_ratio = act_p50 / bare_p50`` (target: act <= 1.1 x bare + 0.5 ms);
- ``socket_ms``: one actor's act round trip through a real ``LearnerService`` +
  ``InferenceServer`` (loopback), from the actor's ``LearnerClient``;
- ``actors``: actions/s (chunks/s x chunk size) with 1, 4, 8, 16 concurrent actors, each a
  separate process running the real ``actor.client.LearnerClient`` in a closed loop, with the
  mean served batch size (target: 8 actors >= 4 x the actions/s of 1);
- ``train_step_ms``: one LoRA training step (bc_loss, backward, AdamW) at ``--train-batch``;
- ``peak_gpu_gb``: ``torch.cuda.max_memory_allocated`` while serving, training and running
  the baseline (``build_peak_gpu_gb``: while building);
- ``snapshot_mb`` vs ``model_mb``: the trainable (LoRA + heads) weight snapshot vs the model,
  and ``load_weights_ms``: loading a snapshot into the serving copy (adapters re-folded);
- PI0 / PI0.5, ``lerobot_select_action_ms``: lerobot's own ``PI0Policy`` / ``PI05Policy``
  ``select_action`` (queue reset every call, so each call computes a chunk) on the same inputs
  with lerobot's prompt padding, built without LoRA, and ``speedup_vs_lerobot`` = its p50 / the
  act p50 (target >= 8); ``prompt_tokens`` (served prompt columns) against ``prompt_tokens_full``;
- ``peak_matmul``: bf16 ``torch.mm`` of 8192^2 matrices in the same run (float32 256^2 on a CPU);
  ``flops``: FLOPs of one call per batch size in ``--batches`` (FlopCounterMode over the fast
  computation without graphs or compile); ``by_batch``: the bare forward's p50 at each, its
  achieved TFLOP/s and ``mfu`` (that / the peak); each actor level's ``tflops`` / ``mfu``
  count every served chunk as FLOPs(batch 1).

Timings that hold still: each latency takes ``--iters`` (100) timed calls after ``--warmup``,
then more (up to ``--max-iters`` / ``--max-seconds``) until the 95% interval of its median
(order statistics, distribution-free) is within +/-5%; every figure carries ``n``, ``ci95``,
``ci_rel`` and ``stable``, and a wide one is warned about (``warnings``). ``gpu`` holds the
GPU's clocks, power and the other processes on it, read before and after each policy
(``nvidia-smi``; null on the CPU).

    python -m tools.bench.policy                    # GPU, full size, human-readable
    python -m tools.bench.policy --json out.json    # also write every figure as JSON
    python -m tools.bench.policy --tiny --device cpu --actors 1,2 --seconds 2   # CPU smoke

Imports only torch, transformers, safetensors, tokenizers, timm, peft, lerobot (PI0 modules
alone when lerobot's data stack is absent), pyzmq, msgpack, gymnasium.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import (CI_REL_TARGET, LoopbackLearner, bench_spec, ci_warning, emit_json, gpu_state,
                                matmul_peak, p50_p99, random_obs, timed_ms)
from tools.bench.policy_actors import HASH, TASK, client_main, run_actors


def build(name: str, tiny: bool, device: str, tmp: Path, spec, overrides: dict | None = None):
    """(policy, config) for ``name`` (pi0, pi05, openvla_oft, openvla_oft_discrete) at full size
    (random weights) or tiny (test checkpoint); ``overrides``: config fields set on top."""
    kw = dict(overrides or {})
    from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
    from tools.make_tiny_checkpoints import build_tokenizer, make_openvla_oft, make_pi0

    if name in ("pi0", "pi05"):
        cls, cfg_cls = (Pi0Policy, Pi0PolicyConfig) if name == "pi0" else (Pi05Policy, Pi05PolicyConfig)
        if tiny:
            ck = make_pi0(tmp / name, spec, variant=name, chunk_size=8)
            cfg = cfg_cls(checkpoint=str(ck), chunk_size=8, device=device, lora_rank=4, **kw)
        else:
            cfg = cfg_cls(tokenizer=str(build_tokenizer(tmp / f"{name}_tok", kind="gemma")), device=device, **kw)
        return cls(cfg, spec), cfg
    if name == "openvla_oft_discrete":  # GRPO's OFT: the discrete action-token head
        from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy as cls
        from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicyConfig as cfg_cls
    else:
        cls, cfg_cls = OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    if tiny:
        cfg = cfg_cls(checkpoint=str(make_openvla_oft(tmp / "oft", spec)), device=device, lora_rank=4, **kw)
    else:
        cfg = cfg_cls(tokenizer=str(build_tokenizer(tmp / "oft_tok", kind="llama", vocab_size=2000)), device=device, **kw)
    return cls(cfg, spec), cfg


def bench_policy(name: str, args, spec, tmp: Path) -> dict:
    import torch

    from agents.policies import vla_common as vc
    from learner.weights import WeightPublisher

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    policy, cfg = build(name, args.tiny, args.device, tmp, spec)
    policy.eval()
    res: dict = {"build_s": time.perf_counter() - t0, "chunk": policy.chunk_size}
    if cuda:
        res["build_peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    snap = policy.trainable_state_dict()
    res["params_m"] = vc.n_params(policy) / 1e6
    res["model_mb"] = sum(p.numel() * p.element_size() for p in policy.parameters()) / 1e6
    res["snapshot_mb"] = vc.state_nbytes(snap) / 1e6
    res["snapshot_tensors"] = len(snap)
    obs_np = random_obs(spec.state_dim, spec.cameras)
    obs = {k: torch.from_numpy(v) for k, v in obs_np.items()}
    obs["task"] = [TASK]
    it = args.iters
    timed = _timer(args, sync)
    res["gpu_before"] = gpu_state() if cuda else None
    if callable(getattr(policy, "warm_up", None)):  # as the learner's inference server does first
        t1 = time.perf_counter()
        res["warmup_buckets_s"] = {str(k): round(v, 2) for k, v in (policy.warm_up(max_batch=64) or {}).items()}
        res["warmup_s"] = time.perf_counter() - t1
    with torch.inference_mode():
        inputs = policy.model_inputs(obs)
        res["bare_forward_ms"] = p50_p99(timed(lambda: policy.forward_model(inputs)))
        res["act_ms"] = p50_p99(timed(lambda: policy.act(obs)))
        if not name.startswith("openvla_oft"):
            res["prompt_tokens"] = int(inputs[2].shape[1])
            res["prompt_tokens_full"] = int(policy.prompt_tokens.max_len)
        res["flops"], res["by_batch"] = throughput(policy, obs_np, args, sync, res["bare_forward_ms"])
    with torch.no_grad():  # a new weights version on the serving copy: unfold, load, fold
        res["load_weights_ms"] = p50_p99(timed_ms(lambda: policy.load_trainable_state_dict(snap), 3, 1, sync))
    res["overhead_ratio"] = res["act_ms"]["p50"] / res["bare_forward_ms"]["p50"]
    res["act_target_ms"] = 1.1 * res["bare_forward_ms"]["p50"] + 0.5
    res["act_within_target"] = res["act_ms"]["p50"] <= res["act_target_ms"]

    # through the real learner socket
    learner = LoopbackLearner(policy, spec, HASH, buffer_capacity=8, device=dev,
                              get_version=lambda: pub.version, get_weights=lambda: pub.latest(),
                              service_kw={"peer_timeout_s": 600.0},
                              inference_kw={"max_batch": 64, "batch_window_ms": args.batch_window_ms})
    svc, inf = learner.service, learner.inference
    pub = WeightPublisher(inf.set_weights, svc.publish)
    pub.publish(snap, version=1)
    learner.start()
    try:
        cams = {c: list(s) for c, s in spec.cameras.items()}
        counters = lambda: (inf.batches, inf.served)  # noqa: E731
        one = run_actors(1, svc.port, args.seconds, spec.state_dim, cams, counters)
        res["socket_ms"] = {"p50": one["lat_p50_ms"], "p99": one["lat_p99_ms"]}
        res["actors"] = []
        for n in args.actors:
            r = one if n == 1 else run_actors(n, svc.port, args.seconds, spec.state_dim, cams, counters)
            r["actions_per_s"] = r["chunks_per_s"] * policy.chunk_size
            res["actors"].append(r)
    finally:
        learner.close()
    peak = args.peak_tflops
    for r in res["actors"]:
        r["tflops"] = r["chunks_per_s"] * res["flops"]["1"] / 1e12
        r["mfu"] = r["tflops"] / peak if peak else None
    by_n = {r["actors"]: r["actions_per_s"] for r in res["actors"]}
    if 1 in by_n and 8 in by_n:
        res["scaling_8_vs_1"] = by_n[8] / by_n[1]

    # one LoRA training step
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    bt = args.train_batch
    tb = {k: torch.from_numpy(np.repeat(v, bt, axis=0)) for k, v in obs_np.items()}
    tb["task"] = [TASK] * bt
    tb["action"] = torch.rand(bt, policy.chunk_size, spec.action_dim) * 2 - 1

    def step():
        opt.zero_grad(set_to_none=True)
        policy.bc_loss(tb).backward()
        opt.step()
    res["train_step_ms"] = p50_p99(timed_ms(step, max(2, it // 5), 1, sync))
    res["train_batch"] = bt
    del opt
    policy.eval()

    if name in ("pi0", "pi05") and not args.no_baseline:
        res["lerobot_select_action_ms"] = lerobot_baseline(policy, obs, args, sync)
        res["speedup_vs_lerobot"] = res["lerobot_select_action_ms"]["p50"] / res["act_ms"]["p50"]
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    res["gpu_after"] = gpu_state() if cuda else None
    res["warnings"] = _warnings(name, res)
    del policy
    return res


def throughput(policy, obs_np: dict, args, sync, batch1_ms: dict) -> tuple[dict, dict]:
    """({batch: FLOPs of one call}, {batch: bare forward p50, TFLOP/s, MFU}) for ``--batches``.
    FLOPs are counted on the fast computation run without graphs or compile (what the graphs
    replay; FlopCounterMode sees no kernels inside a graph), then the served path is timed
    (batch 1: ``batch1_ms``, the bare forward already timed)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from agents.policies.openvla_oft.fast import FastOFT
    from agents.policies.pi0.fast import FastPiSampler

    flops, by = {}, {}
    for b in args.batches:
        ob = {k: torch.from_numpy(np.repeat(v, b, axis=0)) for k, v in obs_np.items()}
        ob["task"] = [TASK] * b
        with torch.inference_mode():
            inputs = policy.model_inputs(ob)
            served = policy.__dict__.get("_fast")
            policy.__dict__["_fast"] = (FastOFT(policy, graphs=False) if hasattr(policy, "head_kind") else
                                        FastPiSampler(policy.inner.model, policy.variant, graphs=False))
            mode, policy.cfg.fast_serving = policy.cfg.fast_serving, "eager"
            try:
                with FlopCounterMode(display=False) as fc:
                    policy.forward_model(inputs)
            finally:
                policy.__dict__["_fast"], policy.cfg.fast_serving = served, mode
            flops[str(b)] = float(fc.get_total_flops())
            t = batch1_ms if b == 1 else p50_p99(timed_ms(
                lambda: policy.forward_model(inputs), max(3, args.iters // 4), args.warmup, sync,
                max_iters=max(3, args.max_iters // 4), max_s=args.max_seconds / 2))
        tf = flops[str(b)] / (t["p50"] / 1e3) / 1e12
        by[str(b)] = {"forward_ms": t, "tflops": tf, "mfu": tf / args.peak_tflops if args.peak_tflops else None}
    return flops, by


def _timer(args, sync):
    """``fn -> samples``: --iters calls, extended until the median's interval is narrow."""
    return lambda fn: timed_ms(fn, args.iters, args.warmup, sync, max_iters=args.max_iters,
                               max_s=args.max_seconds)


def _warnings(name: str, res: dict) -> list[str]:
    out = []
    for key in ("bare_forward_ms", "act_ms", "lerobot_select_action_ms"):
        if key in res and (w := ci_warning(f"{name} {key}", res[key])):
            out.append(w)
    for when in ("gpu_before", "gpu_after"):
        g = res.get(when) or {}
        if g.get("shared"):
            out.append(f"{name}: other processes on the GPU ({when}): {g['other_processes']}")
        if g.get("sm_clock_mhz") and g.get("max_sm_clock_mhz") and \
                g["sm_clock_mhz"] < 0.8 * g["max_sm_clock_mhz"]:
            out.append(f"{name}: SM clock {g['sm_clock_mhz']:.0f} MHz {when}, under 80% of its "
                       f"maximum {g['max_sm_clock_mhz']:.0f} MHz (throttled or idle)")
    for w in out:
        print("WARNING:", w, file=sys.stderr, flush=True)
    return out


def lerobot_baseline(policy, obs, args, sync) -> dict:
    """lerobot's own PI0Policy / PI05Policy.select_action (a copy without LoRA, same weights) on the
    same batch, its prompt padded as lerobot pads it."""
    import torch

    from agents.policies.pi0.policy import build_lerobot_pi

    plain = build_lerobot_pi(policy.variant, policy.lr_cfg, policy.arch, seed=policy.cfg.seed)
    base = {k: v for k, v in policy.inner.state_dict().items() if ".lora_" not in k}
    plain.load_state_dict({k.replace(".base_layer", ""): v for k, v in base.items()}, strict=True)
    plain.eval()
    with torch.inference_mode():
        lb = policy.lerobot_batch(obs, full_prompt=True)

        def call():
            plain.reset()
            plain.select_action(lb)
        out = p50_p99(_timer(args, sync)(call))
    del plain
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="pi0,pi05,openvla_oft")
    ap.add_argument("--batches", default="1,4,8", help="bare forward batch sizes for TFLOP/s and MFU")
    ap.add_argument("--tiny", action="store_true", help="tiny test-size models (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--actors", default="1,4,8,16")
    ap.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    ap.add_argument("--iters", type=int, default=100, help="timed calls per latency, at least")
    ap.add_argument("--max-iters", type=int, default=1000,
                    help=f"more calls, up to this many, while the median's 95%% interval is wider "
                         f"than +/-{CI_REL_TARGET:.0%}")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="per latency, for the extension")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--batch-window-ms", type=float, default=2.0)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout only JSON)")
    # actor process mode
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--actor-id", help=argparse.SUPPRESS)
    ap.add_argument("--state-dim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cams", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--period", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--env", default=None, help=argparse.SUPPRESS)  # JSON env config: a simulated actor
    ap.add_argument("--execute", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--local", action="store_true", help=argparse.SUPPRESS)  # a simulated actor with no learner
    args = ap.parse_args(argv)
    if args.client:
        client_main(args)
        return {}

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny models: threads only fight the actor processes for cores
    args.actors = [int(x) for x in args.actors.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    s = args.image_size
    spec = bench_spec(8, 7, ["image", "wrist_image"], s, has_task=True)
    out = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "tiny": args.tiny, "image_size": s, "policies": {}}
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    out["peak_matmul"] = matmul_peak(args.device, 256 if args.tiny else 8192)
    args.peak_tflops = out["peak_matmul"]["tflops"]
    say(f"peak matmul {args.peak_tflops:.1f} TFLOP/s ({out['peak_matmul']['dtype']}, n {out['peak_matmul']['n']})")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.policies.split(","):
            say(f"== {name} ({'tiny' if args.tiny else 'full size'}, {out['device']})", flush=True)
            r = bench_policy(name, args, spec, Path(tmp))
            out["policies"][name] = r
            say(report(name, r), flush=True)
    if args.json:
        emit_json(out, args.json)
    return out


def report(name: str, r: dict) -> str:
    lines = [f"  params {r['params_m']:.1f} M, model {r['model_mb']:.1f} MB, trainable snapshot "
             f"{r['snapshot_mb']:.2f} MB ({r['snapshot_tensors']} tensors, {r['snapshot_mb'] / r['model_mb']:.2%}), "
             f"build {r['build_s']:.1f} s",
             f"  bare forward p50 {r['bare_forward_ms']['p50']:.2f} ms {_ci(r['bare_forward_ms'])} p99 "
             f"{r['bare_forward_ms']['p99']:.2f} ms",
             f"  act          p50 {r['act_ms']['p50']:.2f} ms {_ci(r['act_ms'])} p99 {r['act_ms']['p99']:.2f} ms  overhead x"
             f"{r['overhead_ratio']:.3f} (target <= {r['act_target_ms']:.2f} ms: "
             f"{'ok' if r['act_within_target'] else 'MISSED'})",
             f"  socket, 1 actor p50 {r['socket_ms']['p50']:.2f} ms p99 {r['socket_ms']['p99']:.2f} ms",
             f"  new weights version on the serving copy p50 {r['load_weights_ms']['p50']:.1f} ms"]
    for a in r["actors"]:
        lines.append(f"  {a['actors']:>2} actors: {a['actions_per_s']:9.1f} actions/s ({a['chunks_per_s']:.1f} chunks/s, "
                     f"mean batch {a['mean_batch']:.1f}, p50 {a['lat_p50_ms']:.1f} ms)")
    if "scaling_8_vs_1" in r:
        lines.append(f"  8 vs 1 actors: x{r['scaling_8_vs_1']:.2f} (target >= 4: "
                     f"{'ok' if r['scaling_8_vs_1'] >= 4 else 'MISSED'})")
    for b, x in r.get("by_batch", {}).items():
        lines.append(f"  batch {b:>2}: forward p50 {x['forward_ms']['p50']:.2f} ms, {r['flops'][b] / 1e12:.3f} TFLOP/call, "
                     f"{x['tflops']:.1f} TFLOP/s" + (f" = {x['mfu']:.1%} of the matmul peak" if x["mfu"] else ""))
    for a in r["actors"]:
        if a.get("mfu"):
            lines.append(f"  {a['actors']:>2} actors: {a['tflops']:.1f} TFLOP/s = {a['mfu']:.1%} of the matmul peak")
    if "prompt_tokens" in r:
        lines.append(f"  prompt: {r['prompt_tokens']} token columns served (lerobot pads to {r['prompt_tokens_full']})")
    lines.append(f"  LoRA train step (batch {r['train_batch']}) p50 {r['train_step_ms']['p50']:.1f} ms")
    if "lerobot_select_action_ms" in r:
        b = r["lerobot_select_action_ms"]
        lines.append(f"  lerobot {name} select_action p50 {b['p50']:.2f} ms p99 {b['p99']:.2f} ms (no LoRA): act is "
                     f"x{r['speedup_vs_lerobot']:.1f} faster (target >= 8: {'ok' if r['speedup_vs_lerobot'] >= 8 else 'MISSED'})")
    for when in ("gpu_before", "gpu_after"):
        g = r.get(when)
        if g and "sm_clock_mhz" in g:
            lines.append(f"  GPU {when[4:]}: SM {g['sm_clock_mhz']} / {g['max_sm_clock_mhz']} MHz, mem "
                         f"{g['mem_clock_mhz']} MHz, {g['power_w']} W, {g['temperature_c']} C, other "
                         f"processes: {len(g['other_processes'])}")
    for w in r.get("warnings", []):
        lines.append(f"  WARNING: {w}")
    if "peak_gpu_gb" in r:
        lines.append(f"  peak GPU memory {r['peak_gpu_gb']:.1f} GB serving + training (building: "
                     f"{r['build_peak_gpu_gb']:.1f} GB)")
    return "\n".join(lines)


def _ci(stats: dict) -> str:
    """``[lo, hi] (n N)``: the p50's 95% interval, or why there is none."""
    if stats.get("ci95") is None:
        return f"(n {stats['n']}, too few for an interval)"
    lo, hi = stats["ci95"]
    return f"[95% {lo:.2f}-{hi:.2f}, +/-{stats['ci_rel']:.1%}, n {stats['n']}]"


if __name__ == "__main__":
    main()

