"""The scaling benchmark's matrix (``python -m tools.bench.scaling_cli --matrix``): one launch per
case x configuration, each a subprocess (``accelerate launch`` on GPUs; plain python or
``torchrun`` with gloo on the CPU), then a table with samples/s relative to the case's 1-GPU
row and the scaling efficiency samples/s(N) / (N x samples/s(1)). Writes
``<out-dir>/<case>__<config>.json`` (rank 0's result), ``.log`` (the launch's output),
``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: name -> (processes, DeepSpeed ZeRO stage; 0 = none: one process, or DDP)
CONFIGS = {"1gpu": (1, 0), "1gpu_z2": (1, 2), "1gpu_z3": (1, 3),
           "2gpu_ddp": (2, 0), "2gpu_z2": (2, 2), "2gpu_z3": (2, 3)}
DEFAULT_CONFIGS = ("1gpu", "2gpu_z2", "2gpu_z3")
#: set in every launch's environment (NVLink multicast off; required on the lent machines)
LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REPO = Path(__file__).resolve().parents[2]
TARGET = 1.8  # issue 11: 2 GPUs >= 1.8x the samples/s of 1 at the same global batch


def default_micro(case: str, tiny: bool) -> int:
    return 2 if tiny else (4 if case.startswith("oft") else 8)


def command(args, case: str, config: str, port: int, out_json: Path) -> list[str]:
    """The launch of one run (a list for subprocess)."""
    n, zero = CONFIGS[config]
    micro = args.micro_batch or default_micro(case, args.tiny)
    bench = ["-m", "tools.bench.scaling_cli", "--case", case, "--global-batch", str(args.global_batch),
             "--micro-batch", str(micro), "--warmup", str(args.warmup), "--steps", str(args.steps),
             "--lr", str(args.lr), "--image-size", str(args.image_size), "--timeout-s", str(args.timeout_s),
             "--json", str(out_json), "--verbose"]
    bench += ["--no-autocast"] * args.no_autocast
    if args.fail_rank is not None:
        bench += ["--fail-rank", str(args.fail_rank)]
    if args.tiny:
        bench += ["--tiny", "--tiny-dir", str(Path(args.tiny_dir or Path(args.out_dir) / "tiny_ckpt").resolve())]
    py = args.python
    if args.cpu:
        if zero:
            raise ValueError(f"{config}: DeepSpeed needs CUDA; use 1gpu / 2gpu_ddp with --cpu")
        bench += ["--cpu", "--threads", str(args.threads)]
        if n == 1:
            return [py, *bench]
        return [py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(n),
                "--master_addr", "127.0.0.1", "--master_port", str(port), *bench]
    launch = [py, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    if zero:
        launch += ["--use_deepspeed", "--deepspeed_config_file", str(REPO / f"config/deepspeed/zero{zero}.json")]
    elif n > 1:
        launch += ["--multi_gpu"]
    return [*launch, *bench]


def launch_one(args, case: str, config: str, port: int, out: Path) -> dict:
    out_json, log = out / f"{case}__{config}.json", out / f"{case}__{config}.log"
    out_json.unlink(missing_ok=True)
    for stale in out.glob(f"{out_json.name}.rank*.error"):
        stale.unlink()
    cmd = command(args, case, config, port, out_json)
    env = {**os.environ, **LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.monotonic()
    rc: int | str
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.launch_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # this launch's own process group
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    wall = time.monotonic() - t0
    res = json.loads(out_json.read_text()) if out_json.exists() else {}
    res.update(config=config, case=case, launch_rc=rc, launch_wall_s=wall, log=str(log), command=" ".join(cmd))
    peers = {p.name.rsplit(".", 2)[-2]: p.read_text() for p in sorted(out.glob(f"{out_json.name}.rank*.error"))}
    missed = [f"{k}: {v}" for k, v in peers.items() if v not in (res.get("error") or "")]
    if missed:  # a rank > 0 failed and rank 0 never heard of it (stuck in a collective)
        res["error"] = "; ".join(filter(None, [res.get("error"), *missed]))
    if rc != 0 and not res.get("error"):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        oom = [ln for ln in lines if "out of memory" in ln.lower()][:1]
        res["error"] = f"launch exited {rc} ({'; '.join(t[:200] for t in oom + lines[-3:])})"
    return res


def scale(rows: list[dict]) -> None:
    """Adds ``vs_1gpu`` and ``efficiency`` to every row with a 1-GPU row of the same case."""
    for r in rows:
        base = next((b for b in rows if b["case"] == r["case"] and b["config"] == "1gpu" and b.get("samples_per_s")),
                    None) or next((b for b in rows if b["case"] == r["case"] and b.get("world") == 1
                                   and b.get("samples_per_s")), None)
        if base and r.get("samples_per_s"):
            r["baseline_config"] = base["config"]
            r["vs_1gpu"] = r["samples_per_s"] / base["samples_per_s"]
            r["efficiency"] = r["vs_1gpu"] / max(1, r.get("world", 1))
        # against one GPU under the same DeepSpeed stage (same optimizer precision: ZeRO keeps fp32
        # master weights and moments, a plain AdamW on bf16 weights keeps bf16 ones)
        same = next((b for b in rows if b["case"] == r["case"] and b.get("world") == 1 and b.get("samples_per_s")
                     and b.get("deepspeed_zero_stage") == r.get("deepspeed_zero_stage")), None)
        if same and r.get("samples_per_s") and r.get("world", 1) > 1:
            r["vs_1gpu_same_stage"] = r["samples_per_s"] / same["samples_per_s"]


def table(rows: list[dict]) -> str:
    head = ("| case | config | GPUs | micro x accum | step p50 (s) | samples/s | x 1 GPU | efficiency "
            "| x 1 GPU same stage | peak GB per GPU | trainable (M) | wall (s) | error |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        def f(k, fmt, r=r):
            return (fmt % r[k]) if r.get(k) is not None else "-"
        peaks = "/".join(f"{m['peak_gb']:.1f}" for m in r.get("per_rank", []) if "peak_gb" in m) or "-"
        ratio = f("vs_1gpu", "%.2f")
        if r.get("world", 1) == 2 and r.get("vs_1gpu") is not None:
            ratio += " ok" if r["vs_1gpu"] >= TARGET else f" (< {TARGET})"
        mb = f"{r.get('micro_batch', '-')} x {r.get('accum_steps', '-')}"
        lines.append(f"| {r['case']} | {r['config']} | {r.get('world', CONFIGS[r['config']][0])} | {mb} "
                     f"| {f('step_s_p50', '%.3f')} | {f('samples_per_s', '%.2f')} | {ratio} "
                     f"| {f('efficiency', '%.2f')} | {f('vs_1gpu_same_stage', '%.2f')} | {peaks} | {f('trainable_params_m', '%.2f')} "
                     f"| {f('launch_wall_s', '%.0f')} | {(r.get('error') or '')[:160]} |")
    return "\n".join(lines)


def run_matrix(args) -> list[dict]:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in args.cases.split(",") if c]
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; choose from {list(CONFIGS)}")
    if args.dry_run:
        for i, (case, config) in enumerate((c, k) for c in cases for k in configs):
            print(" ".join(command(args, case, config, args.port + i, out / f"{case}__{config}.json")))
        return []
    rows, t0 = [], time.monotonic()
    if args.tiny:  # the tiny checkpoints once, here, instead of on every rank of every launch
        from tools.bench.common import bench_spec
        from tools.bench.scaling import tiny_checkpoint

        spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size, has_task=True)
        for case in cases:
            tiny_checkpoint(case, spec, Path(args.tiny_dir or out / "tiny_ckpt").resolve())
    for i, (case, config) in enumerate((c, k) for c in cases for k in configs):
        print(f"[matrix] {case} {config} ...", flush=True)
        r = launch_one(args, case, config, args.port + i, out)
        rows.append(r)
        print(f"[matrix] {case} {config}: " + (f"{r['samples_per_s']:.2f} samples/s, step {r['step_s_p50']:.3f} s"
              if r.get("samples_per_s") else f"error: {r.get('error')}") + f" ({r['launch_wall_s']:.0f} s)",
              flush=True)
    scale(rows)
    md = table(rows)
    summary = {"rows": rows, "total_wall_s": time.monotonic() - t0, "target_vs_1gpu": TARGET,
               "global_batch": args.global_batch, "env": LAUNCH_ENV}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(md + "\n")
    print(md)
    print(f"[matrix] {len(rows)} launches in {summary['total_wall_s']:.0f} s; files in {out}", file=sys.stderr)
    return rows
