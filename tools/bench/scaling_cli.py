"""Multi-GPU scaling of a BC training step (issue 11): 1 GPU vs 2 GPUs (DDP, ZeRO-2, ZeRO-3)
at a fixed global batch, for OpenVLA-OFT (7.5B, LoRA) and PI0 (3.3B, LoRA or every parameter
trained).

One run, on every rank of a launch (tools/bench/scaling.py says what each rank does):

    python -m accelerate.commands.launch --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --use_deepspeed --deepspeed_config_file config/deepspeed/zero3.json \\
        -m tools.bench.scaling_cli --case pi0_full --global-batch 32 --micro-batch 8 --json out.json

(N=1 without DeepSpeed: ``--num_processes 1`` and nothing else; N>1 without DeepSpeed:
``--multi_gpu``.) Rank 0 writes the JSON: step time (p50 of ``--steps`` timed steps after
``--warmup``), ``samples_per_s`` = global batch / step time, every rank's peak GPU memory
(``per_rank``, ``peak_gb_max``), trainable parameters, and ``error`` (null, or what failed:
out of memory, ...).

The matrix (tools/bench/scaling_matrix.py; every launch a subprocess with NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) and its table, with the
scaling efficiency samples/s(2 GPUs) / (2 x samples/s(1 GPU)):

    python -m tools.bench.scaling_cli --matrix --out-dir scaling_out           # GPU, full size
    python -m tools.bench.scaling_cli --matrix --cases pi0_full --configs 1gpu,2gpu_z3
    python -m tools.bench.scaling_cli --matrix --tiny --cpu --configs 1gpu,2gpu_ddp   # CPU smoke

Act latency while training: tools/bench/act_latency.py (a serving copy on rank 0 and actors acting).
"""

from __future__ import annotations

import argparse
import sys


def parse(argv=None):
    from tools.bench.scaling import CASES
    from tools.bench.scaling_matrix import CONFIGS, DEFAULT_CONFIGS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, default="pi0_lora", help="one run: the policy and what trains")
    ap.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step, all ranks together")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="samples per forward/backward on a rank (default: 4 for OFT, 8 for PI0; "
                         "--tiny: 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--tiny", action="store_true", help="the tiny test checkpoints (CPU smoke test)")
    ap.add_argument("--tiny-dir", default=None, help="with --tiny: make the tiny checkpoints here once, reuse them")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (gloo between ranks)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank with --cpu")
    ap.add_argument("--no-autocast", action="store_true",
                    help="the plain BCLoss forward (default: under PolicyCalls' bf16 autocast when the "
                         "weights are bf16, which a DeepSpeed bf16 engine makes them)")
    ap.add_argument("--timeout-s", type=float, default=180.0,
                    help="collective timeout (a rank stuck after its peer's out-of-memory ends after it)")
    ap.add_argument("--verbose", action="store_true", help="rank 0 prints every step's time")
    ap.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests: that rank fails
    ap.add_argument("--json", default=None, help="rank 0 writes the result here")
    # the matrix
    ap.add_argument("--matrix", action="store_true", help="run the launches of --cases x --configs and tabulate")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--out-dir", default="bench_scaling_out", help="the matrix's JSON files and logs")
    ap.add_argument("--launch-timeout-s", type=float, default=420.0, help="per launch, then it is killed")
    ap.add_argument("--port", type=int, default=29517, help="first rendezvous port (one per launch)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true", help="print the matrix's launch commands only")
    args = ap.parse_args(argv)
    if args.micro_batch is None and not args.matrix:  # the matrix picks it per case
        from tools.bench.scaling_matrix import default_micro

        args.micro_batch = default_micro(args.case, args.tiny)
    return args


def main(argv=None):
    args = parse(argv)
    if args.matrix:
        from tools.bench.scaling_matrix import run_matrix

        return run_matrix(args)
    import torch

    from tools.bench.common import bench_spec
    from tools.bench.scaling import run, write_json

    if not args.cpu and not torch.cuda.is_available():
        args.cpu = True
    spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size, has_task=True)
    res = run(args, spec)
    if res is not None:
        write_json(res, args.json)
        sps = res.get("samples_per_s")
        print(f"[bench_scaling] {res['case']} {res['mode']} x{res['world']}: "
              + (f"step {res['step_s_p50']:.3f} s, {sps:.2f} samples/s, peak {res.get('peak_gb_max', 0):.1f} GB"
                 if sps else f"error: {res['error']}"), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
