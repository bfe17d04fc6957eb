"""Update-step benchmark for the VLA algorithms: full-size models (random weights, bf16 on a
GPU, LoRA) or the tiny test checkpoints on a CPU.

Per case, one update of ``--batch`` action chunks through the algorithm's own update code:

- ``oft_grpo``: OpenVLA-OFT with the 256-bin token head, :class:`agents.grpo.agent.GRPOAgent`
  (clipped ratio over the 7 x 8 action tokens' log-probs, one epoch, minibatches of
  ``--minibatch``), log-probs of the behaviour policy recomputed (``is_truncation``);
- ``pi0_ppo``: PI0 with Flow-Noise (``flow_rl=noise``, :mod:`agents.policies.pi0.flow_rl`),
  :class:`agents.ppo.agent.PPOAgent` with the policy's own value head (one epoch, minibatches of
  ``--minibatch``): the behaviour log-probs of the stored denoising chains and the values
  recomputed, then the clipped ratio over the chains' joint log-probs plus the value loss;
- ``pi0_noise_sac``: noise-space SAC (DSRL) with PI0 frozen: one update (frozen features of
  obs + next obs, one critic and one actor step), the feature pass and the cached-feature
  critic step apart, updates/s (:mod:`tools.bench.noise_sac`; not in the default ``--cases``);
- ``oft_residual_sac``: residual SAC (PLD) with OpenVLA-OFT (L1 head) frozen: one update (one
  frozen VLA pass over obs + next obs for features and base chunks, one critic and one actor
  step), the pieces apart (:mod:`tools.bench.residual_sac`; not in the default ``--cases``);
- ``pi0_sft`` / ``oft_sft``: the policy's own BC loss (flow matching / L1) as the rejection
  sampling learner runs it, one step over ``--batch`` samples in minibatches;
- ``pi0_small_sft``: the same on ``policy=pi0_small`` (the 10.4M-parameter PI0 trained from
  scratch in float32 for the LIBERO runs; ``--image-size 64``, the whole batch in one pass),
  once per ``--matmul-precisions`` entry (torch's float32 matmul precision: highest = float32,
  high = TF32; ``autocast-bf16`` = float32 weights with the forward under bf16 autocast);

each with the time per update (p50 over ``--iters``) and the peak GPU memory.

    python -m tools.bench.train                                 # GPU, full size
    python -m tools.bench.train --tiny --device cpu --batch 8 --minibatch 4 --iters 2
    python -m tools.bench.train --cases pi0_small_sft --image-size 64 --batch 256 --minibatch 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import bench_spec, emit_json, p50_p99, random_obs, timed_ms


def _build(name: str, tiny: bool, device: str, tmp: Path, spec):
    from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicy
    from agents.policies.openvla_oft.discrete import OpenVLAOFTDiscretePolicyConfig as OpenVLAOFTPolicyConfig
    from tools.bench.policy import build
    from tools.make_tiny_checkpoints import build_tokenizer, make_openvla_oft, make_pi0

    if name == "pi0_flow":
        from agents.policies.pi0.flow_rl import Pi0FlowRLPolicy
        from agents.policies.pi0.policy import Pi0PolicyConfig

        if tiny:
            cfg = Pi0PolicyConfig(checkpoint=str(make_pi0(tmp / "pi0_flow", spec)), chunk_size=8, device=device,
                                  lora_rank=4, flow_rl="noise")
        else:
            cfg = Pi0PolicyConfig(tokenizer=str(build_tokenizer(tmp / "pi0_flow_tok", kind="gemma")), device=device,
                                  flow_rl="noise")
        return Pi0FlowRLPolicy(cfg, spec)
    if name == "pi0_small":  # as the LIBERO chain builds it (config/policy/pi0_small.yaml); no tiny size
        from agents.registry import build_policy
        from tools.sft import learner_config

        cfg = learner_config(["policy=pi0_small", f"policy.device={device}",
                              f"policy.image_size={next(iter(spec.cameras.values()))[0]}"])
        return build_policy(cfg.policy, spec)
    if name != "oft_discrete":
        return build(name, tiny, device, tmp, spec)[0]
    if tiny:
        cfg = OpenVLAOFTPolicyConfig(checkpoint=str(make_openvla_oft(tmp / "oftd", spec)), device=device,
                                     lora_rank=4, action_head="discrete")
    else:
        cfg = OpenVLAOFTPolicyConfig(tokenizer=str(build_tokenizer(tmp / "oftd_tok", kind="llama", vocab_size=2000)),
                                     device=device, action_head="discrete")
    return OpenVLAOFTDiscretePolicy(cfg, spec)


def _batch(policy, spec, n: int, task: str):
    import torch

    obs = random_obs(spec.state_dim, spec.cameras, 1, seed=0)
    b = {k: torch.from_numpy(np.repeat(v, n, axis=0)) for k, v in obs.items()}
    b["task"] = [task] * n
    b["action"] = torch.rand(n, policy.chunk_size, spec.action_dim) * 2 - 1
    return b


def bench_case(case: str, args, spec, tmp: Path) -> dict:
    import torch
    from accelerate import Accelerator

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    name = {"oft_grpo": "oft_discrete", "pi0_ppo": "pi0_flow", "pi0_sft": "pi0", "oft_sft": "openvla_oft",
            "pi0_small_sft": "pi0_small"}[case]
    t0 = time.perf_counter()
    policy = _build(name, args.tiny, args.device, tmp, spec)
    res: dict = {"build_s": time.perf_counter() - t0, "chunk": policy.chunk_size, "batch": args.batch,
                 "minibatch": args.minibatch,
                 "trainable_params_m": sum(p.numel() for p in policy.parameters() if p.requires_grad) / 1e6}
    policy.train()
    batch = _batch(policy, spec, args.batch, "pick up the cube")
    if case == "oft_grpo":
        from agents.grpo.agent import GRPOAgent, GRPOConfig

        agent = GRPOAgent(GRPOConfig(epochs=1, minibatch_size=args.minibatch, lr=1e-5), policy,
                          Accelerator(cpu=not cuda, mixed_precision="no"))
        with torch.no_grad():
            policy.eval()
            chunk = policy.act({k: v[: args.minibatch] for k, v in batch.items() if k != "action"})
            policy.train()
        reps = -(-args.batch // args.minibatch)
        batch["action"] = chunk.actions.cpu().repeat(reps, 1, 1)[: args.batch]
        batch["old_log_prob"] = chunk.log_prob.float().cpu().repeat(reps)[: args.batch]
        batch["advantages"] = torch.randn(args.batch)

        def step():
            agent.update(batch)
    elif case == "pi0_ppo":
        from agents.ppo.agent import PPOAgent, PPOConfig

        agent = PPOAgent(PPOConfig(epochs=1, minibatch_size=args.minibatch, lr=1e-5, is_truncation=2.0),
                         policy, policy, Accelerator(cpu=not cuda, mixed_precision="no"))
        with torch.no_grad():
            policy.eval()
            chunk = policy.act({k: v[: args.minibatch] for k, v in batch.items() if k != "action"})
            policy.train()
        reps = -(-args.batch // args.minibatch)
        def rep(t):
            return t.cpu().repeat(reps, *([1] * (t.ndim - 1)))[: args.batch]
        batch["action"] = rep(chunk.actions)
        batch["old_log_prob"] = rep(chunk.log_prob.float())
        batch.update({f"extra.{k}": rep(v) for k, v in chunk.extras.items()})
        batch["advantages"] = torch.randn(args.batch)
        batch["returns"] = torch.randn(args.batch)

        def step():
            agent.update(batch)
    else:
        params = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)
        mbs = [{k: v[i: i + args.minibatch] for k, v in batch.items()}
               for i in range(0, args.batch, args.minibatch)]

        def step():
            opt.zero_grad(set_to_none=True)
            for mb in mbs:  # gradient accumulation over the minibatches of one update
                (policy.bc_loss(mb) * (len(mb["action"]) / args.batch)).backward()
            opt.step()
    res["update_ms"] = p50_p99(timed_ms(step, args.iters, 1, sync))
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del policy
    return res


def bench_precision(case: str, args, spec, tmp: Path, prec: str) -> dict:
    """``bench_case`` under one float32 matmul precision (or bf16 autocast), restored after."""
    import contextlib

    import torch

    old = torch.get_float32_matmul_precision()
    auto = prec == "autocast-bf16"
    torch.set_float32_matmul_precision("highest" if auto else prec)
    try:
        with (torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16) if auto
              else contextlib.nullcontext()):
            return bench_case(case, args, spec, tmp)
    finally:
        torch.set_float32_matmul_precision(old)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="oft_grpo,pi0_ppo,pi0_sft,oft_sft")
    ap.add_argument("--tiny", action="store_true", help="tiny test-size models (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--batch", type=int, default=64, help="action chunks per update")
    ap.add_argument("--minibatch", type=int, default=16, help="chunks per forward/backward")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--matmul-precisions", default="highest,high,autocast-bf16",
                    help="pi0_small_sft: float32 matmul precisions to time (highest, high, medium, autocast-bf16)")
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout only JSON)")
    args = ap.parse_args(argv)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size, has_task=True)
    out = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "tiny": args.tiny, "cases": {}}
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            try:
                if case == "pi0_noise_sac":  # noise-space SAC (DSRL): tools/bench/noise_sac.py
                    from tools.bench.noise_sac import bench_noise_sac

                    r = bench_noise_sac(args, spec, Path(tmp))
                elif case == "oft_residual_sac":  # residual SAC (PLD) on OFT's L1 head: tools/bench/residual_sac.py
                    from tools.bench.residual_sac import bench_residual_sac

                    r = bench_residual_sac(args, spec, Path(tmp))
                elif case == "pi0_small_sft":  # one row per float32 matmul precision
                    r = {}
                    for prec in args.matmul_precisions.split(","):
                        r[prec] = bench_precision(case, args, spec, Path(tmp), prec)
                        say(f"{case} [{prec}]: {r[prec]}", flush=True)
                else:
                    r = bench_case(case, args, spec, Path(tmp))
            except torch.OutOfMemoryError as exc:  # report it and go on with the next case
                r = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
                torch.cuda.empty_cache()
            out["cases"][case] = r
            say(f"{case}: {r}", flush=True)
    if args.json:
        emit_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
