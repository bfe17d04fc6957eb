"""Act latency of a full-size VLA while a multi-GPU update runs (issue 11).

N ranks (``accelerate launch``, DeepSpeed ZeRO-2/3 or DDP) each build the full-size policy
(random bf16 weights, as tools/bench/scaling.py: PI0 3.3B or OpenVLA-OFT 7.5B, LoRA or full)
and train it with the scaling bench's BC step through one ``accelerator.prepare``-d engine
(the same prepare/backward/step path as the learner's algorithms: PPO's PolicyCalls). Rank 0
also builds the serving copy (a second full model, on ``--serve-device``, default rank 0's
GPU, as ``inference.device: null``) behind the learner's real ``LearnerService`` +
``InferenceServer`` on loopback, and ``--actors`` actor processes (the real
``actor.client.LearnerClient``, tools/bench/policy_actors.py) act in a closed loop for
``--seconds``, twice:

- ``idle``: nothing trains (the ranks wait at a barrier);
- ``train``: every rank runs optimizer steps back to back for the whole window (rank 0
  broadcasts "go on" before each step, so all ranks stop together once the actors are done).

Before both, ``--alone-steps`` timed steps with nothing served give the step time alone. Rank
0 writes act p50/p99 (ms) per phase, their ratio train/idle, optimizer steps done during the
window, the step time with and without serving, and every rank's peak GPU memory.

Not the whole learner app: no ingest, replay or weight publishing runs during the window (the
updates are the BC step on random batches, not an RL algorithm's); what the figure measures is
how much a 2-GPU update on the serving GPU delays the acts the service answers.

    python -m tools.bench.act_latency --launch --gpus 2 --stage 2 --case pi0_lora --json act.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path



def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", action="store_true", help="start --gpus ranks of this under accelerate launch")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 2, 3), help="DeepSpeed ZeRO stage (0: DDP)")
    ap.add_argument("--case", default="pi0_lora", choices=("pi0_lora", "pi0_full", "oft_lora"))
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--actors", type=int, default=1, help="actor processes acting in a closed loop")
    ap.add_argument("--seconds", type=float, default=30.0, help="each phase's timed window")
    ap.add_argument("--alone-steps", type=int, default=4, help="timed steps with nothing served, first")
    ap.add_argument("--serve-device", default=None, help="the serving copy's device (default: rank 0's GPU)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def launch(args) -> int:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.gpus),
           "--num_machines", "1", "--main_process_port", str(args.port), "--mixed_precision", "no",
           "--dynamo_backend", "no"]
    cmd += (["--use_deepspeed", "--deepspeed_config_file", f"config/deepspeed/zero{args.stage}.json"]
            if args.stage else (["--multi_gpu"] if args.gpus > 1 else []))
    rest = [a for a in sys.argv[1:] if a != "--launch"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return subprocess.call(cmd + ["-m", "tools.bench.act_latency", *rest], env=env)


def main(argv=None) -> dict | None:
    args = parse(argv)
    if args.launch:
        raise SystemExit(launch(args))
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from datetime import timedelta

    from agents.parallel import accelerator_kwargs, uses_deepspeed
    from tools.bench.common import LoopbackLearner, bench_spec
    from tools.bench.policy_actors import HASH, run_actors
    from tools.bench.scaling import BCStep, build_policy, micro_batches, patch_deepspeed_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank = args.global_batch // world
    accum = per_rank // args.micro_batch
    tmp = Path(tempfile.mkdtemp(prefix="act_latency_"))
    patch_deepspeed_config(accum, args.micro_batch, tmp)
    acc = Accelerator(gradient_accumulation_steps=accum, kwargs_handlers=accelerator_kwargs() + [
        InitProcessGroupKwargs(timeout=timedelta(seconds=900))])
    rank, dev = acc.process_index, acc.device
    spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size, has_task=True)
    torch.manual_seed(0)
    policy = build_policy(args.case, False, str(dev), tmp, spec)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=not uses_deepspeed(acc))
    model, opt = acc.prepare(BCStep.module(policy, True), opt)
    mbs = micro_batches(policy, spec, per_rank, args.micro_batch, dev, seed=rank + 1)

    def step():
        for mb in mbs:
            with acc.accumulate(model):
                acc.backward(model(mb))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, first NCCL calls)
    torch.cuda.synchronize(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.alone_steps):  # the step time with nothing served (before the serving copy exists)
        step()
    torch.cuda.synchronize(dev)
    alone_s = (time.perf_counter() - t0) / max(args.alone_steps, 1)
    res: dict = {"case": args.case, "world": world, "stage": args.stage, "global_batch": args.global_batch,
                 "micro_batch": args.micro_batch, "actors": args.actors, "seconds": args.seconds,
                 "device": torch.cuda.get_device_name(dev),
                 "train_alone": {"steps": args.alone_steps, "step_s": alone_s,
                                 "samples_per_s": args.global_batch / alone_s}}
    stack = None
    if rank == 0:
        sdev = torch.device(args.serve_device) if args.serve_device else dev
        with torch.cuda.device(sdev):
            serving = build_policy(args.case.replace("_full", "_lora"), False, str(sdev), tmp / "serve", spec)
        serving.eval()
        stack = LoopbackLearner(serving, spec, HASH, buffer_capacity=8, device=sdev,
                                service_kw={"peer_timeout_s": 600.0},
                                inference_kw={"max_batch": 64, "batch_window_ms": 2.0})
        stack.start()
        res["serve_device"] = str(sdev)
    cams = {c: list(s) for c, s in spec.cameras.items()}
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    for phase in ("idle", "train"):
        dist.barrier()
        out: dict = {}
        if rank == 0:
            th = threading.Thread(target=lambda: out.update(run_actors(
                args.actors, stack.port, args.seconds, spec.state_dim, cams)), daemon=True)
            th.start()
        steps, t0 = 0, time.perf_counter()
        while phase == "train":
            flag.fill_(int(rank == 0 and th.is_alive()))
            dist.broadcast(flag, src=0)
            if not int(flag):
                break
            step()
            steps += 1
        torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        if rank == 0:
            th.join()
            res[phase] = {"act_p50_ms": out["lat_p50_ms"], "act_p99_ms": out["lat_p99_ms"],
                          "chunks": out["chunks"], "mean_batch": out["mean_batch"]}
            if phase == "train":
                res[phase].update(steps=steps, step_s=dt / max(steps, 1),
                                  samples_per_s=steps * args.global_batch / dt)
    if rank == 0:
        res["p50_ratio_train_vs_idle"] = res["train"]["act_p50_ms"] / res["idle"]["act_p50_ms"]
        res["p99_ratio_train_vs_idle"] = res["train"]["act_p99_ms"] / res["idle"]["act_p99_ms"]
        res["step_ratio_serving_vs_alone"] = res["train"]["step_s"] / alone_s
    peaks: list = [None] * world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(dev) / 1e9)
    if rank == 0:
        res["peak_gb_per_rank"] = peaks
        stack.close()
        print("[act_latency] " + json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()
    return res if rank == 0 else None


if __name__ == "__main__":
    main()
