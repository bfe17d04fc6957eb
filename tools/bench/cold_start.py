"""Start-up to serving: cold, cold with shipped compile artefacts, and warm.

Each case is a fresh process that builds a policy's serving copy (tools.bench.policy.build: full
size with random weights, or ``--tiny``) and constructs the learner's ``InferenceServer``, whose
warm-up compiles and captures the batch buckets it will serve (``--max-batch``), then serves one
act. Measured per case: ``build_s``, ``warmup_s`` (the server's construction: loading the artefacts,
then each bucket's compile and capture, ``warmup_buckets_s``), ``first_act_ms``
and ``to_serving_s`` (process start to the first act served), ``all_buckets_s`` (to every
bucket warmed: with ``--warmup staged``, the learner's default, the server serves after the
smallest and warms the rest between batches; ``all`` warms every one first).

- ``cold``: an empty inductor cache (a machine that never compiled); what it compiled is saved
  as portable artefacts (``inference.compile_artifacts``) in the run's folder;
- ``artefacts``: another empty inductor cache, the artefacts loaded before the warm-up (the
  checkpoint shipped with them);
- ``warm``: the first case's cache again (a restart on the same machine);
- ``aot_cold`` / ``aot`` (OpenVLA-OFT, PI0 / PI0.5: ``policy.fast_aot_dir``): an empty cache compiling the
  layer stack ahead of time into a folder, then another empty cache loading it from there (a
  machine given the ahead-of-time functions: no tracing).

    python -m tools.bench.cold_start --policy pi0 --json out.json     # GPU
    python -m tools.bench.cold_start --policy pi0 --tiny --device cpu # CPU (the fast path compiles only on a GPU)
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

from learner.warmup import WARMUPS
from tools.bench.common import ROOT, bench_spec, emit_json, random_obs

#: (case, inductor cache folder): "warm" reuses the cold case's cache
CASES = (("cold", "a"), ("artefacts", "b"), ("warm", "a"), ("aot_cold", "c"), ("aot", "d"))
#: the policies whose fast path compiles ahead of time (policy.fast_aot_dir)
AOT_POLICIES = ("openvla_oft", "openvla_oft_discrete", "pi0", "pi05")


def child(a) -> None:
    t_start = float(a.t0)
    import torch

    from learner.inference import InferenceServer
    from tools.bench.policy import build
    from tools.bench.policy_actors import TASK

    spec = bench_spec(8, 7, ["image", "wrist_image"], a.image_size, has_task=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        aot = {"fast_aot_dir": a.aot} if a.aot else {}
        if aot and a.device == "cpu":  # the CPU smoke test: the fast path, compiled (a GPU's default)
            aot.update(fast_serving="eager", fast_compile=True)
        policy, _ = build(a.policy, a.tiny, a.device, Path(tmp), spec, overrides=aot or None)
        policy.eval()
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        inf = InferenceServer(policy, reply=lambda *x: None, active_actors=lambda: 1, device=torch.device(a.device),
                              max_batch=a.max_batch, compile_artifacts=a.artifacts, warmup=a.warmup)
        warmup_s = time.perf_counter() - t1
        obs = {k: torch.from_numpy(v).to(a.device) for k, v in random_obs(spec.state_dim, spec.cameras).items()}
        obs["task"] = [TASK]
        t2 = time.perf_counter()
        with torch.inference_mode():
            policy.act(obs)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        first = (time.perf_counter() - t2) * 1000.0
        to_serving = time.time() - t_start
        while inf.warmup.pending:  # staged: the other buckets, as the server's thread would between batches
            inf.warmup.next()
        all_ready = time.time() - t_start
    print(json.dumps({"build_s": build_s, "warmup_s": warmup_s, "buckets": sorted(inf.warmup_s),
                      "warmup_buckets_s": {str(b): round(t, 2) for b, t in sorted(inf.warmup_s.items())},
                      "first_act_ms": first, "to_serving_s": to_serving, "all_buckets_s": all_ready}))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="pi0")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--warmup", default="staged", choices=WARMUPS, help="inference.warmup")
    ap.add_argument("--cases", default="cold,artefacts,warm",
                    help="which of cold, artefacts, warm, aot_cold, aot (artefacts and warm need cold; aot needs "
                         "aot_cold; the aot cases: OpenVLA-OFT, PI0, PI0.5); default: the first three")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--artifacts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--aot", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return {}
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [c for c in a.cases.split(",") if c]
    if not set(cases) <= {c for c, _ in CASES} or ("cold" not in cases and "aot_cold" not in cases) or \
            (set(cases) & {"artefacts", "warm"} and "cold" not in cases) or ("aot" in cases and "aot_cold" not in cases):
        raise SystemExit(f"--cases {a.cases!r}: cold with any of artefacts, warm; aot_cold with aot")
    if {"aot_cold", "aot"} & set(cases) and a.policy not in AOT_POLICIES:
        raise SystemExit(f"--cases aot_cold / aot: {a.policy} has no ahead-of-time path (one of {', '.join(AOT_POLICIES)})")
    out: dict = {"policy": a.policy, "tiny": a.tiny, "device": a.device, "max_batch": a.max_batch,
                 "warmup": a.warmup, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "artefacts"
        art_aot = Path(tmp) / "artefacts_aot"  # what the aot cases ship beside their functions
        for case, cache in CASES:
            if case not in cases:
                continue
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / f"cache_{cache}"),
                       PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            cmd = [sys.executable, "-m", "tools.bench.cold_start", "--child", "--policy", a.policy, "--device",
                   a.device, "--max-batch", str(a.max_batch), "--image-size", str(a.image_size),
                   "--artifacts", str(art_aot if case.startswith("aot") else art), "--warmup", a.warmup, "--t0", repr(time.time())] + (["--tiny"] if a.tiny else []) \
                + (["--aot", str(Path(tmp) / "aot")] if case.startswith("aot") else [])
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError(f"{case} start failed: {r.stderr[-3000:]}")
            out["cases"][case] = res = json.loads(r.stdout.strip().splitlines()[-1])
            folder = art_aot if case.startswith("aot") else art
            res["artefact_files"] = sorted(p.name for p in folder.glob("*.bin")) if folder.exists() else []
            if case.startswith("aot"):
                res["aot_files"] = sorted(p.name for p in (Path(tmp) / "aot").glob("aot-*.bin"))
            print(f"  {case:9s} to serving {res['to_serving_s']:.1f} s (build {res['build_s']:.1f} s, warm-up "
                  f"{res['warmup_s']:.1f} s, first act {res['first_act_ms']:.1f} ms), every bucket "
                  f"{res['all_buckets_s']:.1f} s {res['warmup_buckets_s']}", file=sys.stderr, flush=True)
    if a.json:
        emit_json(out, a.json)
    return out


if __name__ == "__main__":
    main()
