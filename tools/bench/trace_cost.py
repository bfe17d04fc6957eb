"""What a warm start's warm-up spends on the host: the PI0 fast path's compiled stages at full
depth with narrow widths (the tiny model's widths, lerobot's 18 Gemma and 27 SigLIP layers), so
that dynamo's tracing, AOTAutograd and the inductor cache lookups cost what they cost at full
size while the arithmetic is negligible. Two fresh processes on one inductor cache: ``cold``
(empty: compiles) then ``warm`` (the same cache: what a restart, or a machine given shipped
compile artefacts, still pays). Each reports the first compiled act at batch 1 (its own graph:
dynamo specialises batch 1) and then at batch 2 (the dynamic-batch graph), after the inductor CPU
ISA probe (``pick_vec_isa``, a CPU-only cost) is paid and timed apart.

With ``--aot`` two more processes on a second cache, with ``policy.fast_aot_dir``: ``aot_save``
(empty: compiles the prefix stages ahead of time, saves them, compiles the denoising step) then
``aot_warm`` (that cache and those functions: what a restart, or a machine given the artefacts and
the functions, still pays: the step's tracing, the functions' load).

    python -m tools.bench.trace_cost --json out.json                 # CPU, ~5 min on 2 cores
    python -m tools.bench.trace_cost --depth 2 --vision-depth 1      # the tiny model's depth
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import ROOT, emit_json


def child(a) -> None:
    import torch

    torch.set_num_threads(1)
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from tools.bench.common import bench_spec, random_obs
    from tools.make_tiny_checkpoints import TINY_PI0_ARCH, make_pi0

    spec = bench_spec(8, 7, ["image", "wrist_image"], 56, has_task=True)
    ck = Path(a.checkpoint)
    if not ck.exists():
        make_pi0(ck, spec, arch={**TINY_PI0_ARCH, "depth": a.depth, "vision_depth": a.vision_depth}, chunk_size=10)
    t0 = time.perf_counter()
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    pick_vec_isa()
    isa = time.perf_counter() - t0
    p = Pi0Policy(Pi0PolicyConfig(checkpoint=str(ck), chunk_size=10, device="cpu", fast_serving="eager",
                                  fast_compile=True, fast_aot_dir=a.aot_dir), spec).eval()
    one = {k: torch.from_numpy(v) for k, v in random_obs(8, spec.cameras, n=1).items()}
    two = {k: torch.from_numpy(v) for k, v in random_obs(8, spec.cameras, n=2).items()}
    one["task"], two["task"] = ["pick up the bowl"], ["pick up the bowl"] * 2
    out = {"isa_probe_s": isa}
    with torch.inference_mode():
        for name, obs in (("first_b1_s", one), ("again_b1_s", one), ("first_b2_s", two)):
            t = time.perf_counter()
            p.act(obs)
            out[name] = time.perf_counter() - t
    from torch._dynamo.utils import counters
    out["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    if a.aot_dir:
        out["aot"] = {k: {"loaded": f.loaded, "compiled": f.compiled, "failed": f.failed}
                      for k, f in p._fast.aot.items()}  # noqa: SLF001
    print(json.dumps(out))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=18, help="Gemma layers (VLM and expert)")
    ap.add_argument("--vision-depth", type=int, default=27, help="SigLIP layers")
    ap.add_argument("--aot", action="store_true", help="also the aot_save and aot_warm cases (policy.fast_aot_dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--aot-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return {}
    res: dict = {"depth": a.depth, "vision_depth": a.vision_depth, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("cold", "warm") + (("aot_save", "aot_warm") if a.aot else ()):
            aot = case.startswith("aot")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / ("inductor_aot" if aot else "inductor")),
                       PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            r = subprocess.run([sys.executable, "-m", "tools.bench.trace_cost", "--child", "--depth", str(a.depth),
                                "--vision-depth", str(a.vision_depth), "--checkpoint", str(Path(tmp) / "ckpt")]
                               + (["--aot-dir", str(Path(tmp) / "aot")] if aot else []),
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            if r.returncode != 0:
                raise SystemExit(f"trace_cost: the {case} process failed:\n{r.stderr[-3000:]}")
            res["cases"][case] = c = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{case}: ISA probe {c['isa_probe_s']:.1f} s; first act batch 1 {c['first_b1_s']:.1f} s, "
                  f"again {c['again_b1_s'] * 1000:.0f} ms, first at batch 2 {c['first_b2_s']:.1f} s; {c['inductor']}"
                  + (f"; ahead of time {c['aot']}" if "aot" in c else ""),
                  file=sys.stderr, flush=True)
    if a.json:
        emit_json(res, a.json)
    return res


if __name__ == "__main__":
    main()
