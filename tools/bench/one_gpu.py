"""One GPU that serves and trains: every figure of the issue in one run, with one JSON.

Runs three benches one after another, each in a process of its own (each builds its models and
leaves the GPU empty for the next), and writes the combined JSON after each stage, so a run cut
short keeps what it measured:

- ``policy`` (:mod:`tools.bench.policy`): batch-1 act (``act_ms``) and the share of the measured
  bf16 matmul peak at ``--peak-actors`` closed-loop actors (``mfu``), per policy;
- ``train_serve`` (:mod:`tools.bench.train_serve`): training while serving against each alone,
  per policy, actor load (``--period``) and serving setting (``--streams``); by default PI0 with
  rejection sampling's BC step and the discrete OpenVLA-OFT with GRPO's update, under the issue's
  two loads: a chunk every 0.5 s per actor (a robot's rate) and ``sim``, closed-loop simulated
  actors, each stepping its own ``--env`` (LIBERO-spatial, rendering with EGL) between requests
  (``0`` adds the closed loop around a simulator that takes no time);
- ``cold_start`` (:mod:`tools.bench.cold_start`): start-up to the first act served, cold, with
  shipped compile artefacts and warm, per policy in ``--start-policies``.

``summary`` holds the figures the issue's targets name, each beside its target:

- ``train_serve``: per policy, load and stream: the update ratio (train_serve's
  ``update_ratio_judged``: the smaller of updates/s and step-time ratios, >= 0.8) and the act p99
  ratio (<= 1.3), judged by train_serve;
- ``batch1_act_ms``: act p50 at batch 1 (PI0 <= 12 ms, PI0.5 <= 13 ms; no target for OFT);
- ``share_of_peak``: at ``--peak-actors`` actors (PI0 >= 0.6);
- ``start_s``: to serving, cold, with artefacts (<= 30 s) and warm.

    python -m tools.bench.one_gpu --json runs/one_gpu.json          # H200, full size (~30 min)
    python -m tools.bench.one_gpu --tiny --device cpu --policies pi0 --peak-actors 2 \\
        --seconds 2 --repeats 1 --streams window --period 0 --json out.json      # CPU smoke

On the lent GPU machines (10 minutes a command) start it with ``setsid`` and poll its JSON.
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

STAGES = ("policy", "train_serve", "cold_start")

#: batch-1 act p50 targets (ms), by policy
BATCH1_TARGET_MS = {"pi0": 12.0, "pi05": 13.0}
PEAK_SHARE_TARGET = {"pi0": 0.6}
START_TARGET_S = 30.0


def stage_commands(a, stage: str, out: Path) -> list[list[str]]:
    """The command line(s) of one stage, each writing its JSON to ``out`` (one per policy for
    cold_start: ``out`` with the policy's name)."""
    common = (["--tiny"] if a.tiny else []) + (["--device", a.device] if a.device else [])
    py = [sys.executable, "-m"]
    if stage == "policy":
        return [py + ["tools.bench.policy", "--policies", a.policies, "--actors", f"1,{a.peak_actors}",
                      "--seconds", str(a.seconds), "--json", str(out)] + common
                + ([] if a.baseline else ["--no-baseline"])
                + (["--iters", str(a.iters), "--max-iters", str(a.iters)] if a.iters else [])]
    if stage == "train_serve":
        return [py + ["tools.bench.train_serve", "--policies", a.policies, "--actors", str(a.actors),
                      "--period", a.period, "--seconds", str(a.seconds), "--repeats", str(a.repeats),
                      "--streams", a.streams, "--batch-due-ms", str(a.batch_due_ms), "--json", str(out)] + common
                + (["--env", a.env] + [x for kv in env_sets(a) for x in ("--env-set", kv)] if a.env else [])]
    if stage == "cold_start":
        return [py + ["tools.bench.cold_start", "--policy", p, "--json", str(out.with_name(f"{out.stem}_{p}.json"))]
                + common for p in a.start_policies.split(",") if p]
    raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")


def env_sets(a) -> list[str]:
    """train_serve's ``--env-set`` entries: the given ones, else LIBERO's EGL and every task."""
    return a.env_set if a.env_set is not None else ["gl=egl", "task_id=all"]


def load_name(period: str) -> str:
    """A train_serve load's name in the summary."""
    return "closed-loop simulated actors" if period == "sim" else f"period {period} s"


def summarize(res: dict) -> dict:
    """The issue's figures beside their targets, from whatever stages finished."""
    s: dict = {}
    pol = res.get("policy") or {}
    for name, r in (pol.get("policies") or {}).items():
        act = r.get("act_ms") or {}
        if act:
            s.setdefault("batch1_act_ms", {})[name] = {"p50": act["p50"], "p99": act["p99"],
                                                       "target": BATCH1_TARGET_MS.get(name),
                                                       "met": (act["p50"] <= BATCH1_TARGET_MS[name]
                                                               if name in BATCH1_TARGET_MS else None)}
        levels = {a["actors"]: a for a in r.get("actors") or []}
        peak_n = max(levels) if levels else None
        if peak_n is not None and levels[peak_n].get("mfu") is not None:
            m = levels[peak_n]["mfu"]
            s.setdefault("share_of_peak", {})[name] = {
                "actors": peak_n, "mfu": m, "mean_batch": levels[peak_n].get("mean_batch"),
                "target": PEAK_SHARE_TARGET.get(name),
                "met": m >= PEAK_SHARE_TARGET[name] if name in PEAK_SHARE_TARGET else None}
    ts = res.get("train_serve") or {}
    for name, r in (ts.get("policies") or {}).items():
        for period, by in r.get("by_period", {}).items():
            for mode, m in by.items():
                s.setdefault("train_serve", {}).setdefault(name, {}).setdefault(load_name(period), {})[mode] = {
                    "update_ratio": m["update_ratio_judged"], "act_p99_ratio": m["act_p99_ratio"],
                    "act_p99_ms": {"serve": m["act_p99_ms_serve"], "both": m["act_p99_ms_both"]},
                    "met": m["meets_targets"],
                    # where the rest went: the window's share of the both phase, and (closed-loop
                    # simulated actors) training beside the simulators alone over training alone
                    **{k: m[k] for k in ("window_share_both", "sims_ratio") if k in m}}
    for name, r in (res.get("cold_start") or {}).items():
        cases = {c: v["to_serving_s"] for c, v in r.get("cases", {}).items()}
        if cases:
            art = cases.get("artefacts")
            s.setdefault("start_s", {})[name] = {"to_serving_s": cases, "target_artefacts_s": START_TARGET_S,
                                                 "met": art <= START_TARGET_S if art is not None else None}
    return s


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="pi0,openvla_oft_discrete",
                    help="PI0 trains rejection sampling's BC step, the discrete OFT GRPO's update (train_serve --update auto)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--tiny", action="store_true", help="tiny test-size models (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--peak-actors", type=int, default=8, help="closed-loop actors for the share of peak")
    ap.add_argument("--actors", type=int, default=8, help="actors while training")
    ap.add_argument("--period", default="0.5,sim",
                    help="train_serve's actor loads: s between requests, or sim (closed-loop simulated actors)")
    ap.add_argument("--env", default="libero_spatial", help="the simulated actors' env (train_serve --env)")
    ap.add_argument("--env-set", action="append", default=None, metavar="KEY=VALUE",
                    help="its config entries (train_serve --env-set; default: gl=egl task_id=all)")
    ap.add_argument("--streams", default="priority,window")
    ap.add_argument("--batch-due-ms", type=float, default=400.0,
                    help="train_serve's inference.batch_due_ms (every load): closed-loop simulated actors "
                         "served in step, lingering up to a whole cycle of theirs (tools.bench.due_model; "
                         "0: the learner's default, off)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase / actor level")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iters", type=int, default=0, help="timed calls per latency (0: the policy bench's default)")
    ap.add_argument("--start-policies", default="pi0")
    ap.add_argument("--baseline", action="store_true",
                    help="also time lerobot's own select_action in the policy stage (a second full copy)")
    ap.add_argument("--json", required=True, help="the combined JSON, rewritten after each stage")
    a = ap.parse_args(argv)
    stages = [x for x in a.stages.split(",") if x]
    for st in stages:
        if st not in STAGES:
            raise SystemExit(f"--stages: unknown stage {st!r}; one of {', '.join(STAGES)}")
    res: dict = {"args": vars(a), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stage_s": {},
                 "failed": {}}
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory() as tmp:
        for st in stages:
            t0 = time.perf_counter()
            out = Path(tmp) / f"{st}.json"
            for cmd in stage_commands(a, st, out):
                print(f"== {st}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
                r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr, timeout=7200)
                if r.returncode != 0:
                    res["failed"].setdefault(st, []).append({"cmd": cmd[2:], "rc": r.returncode})
            if st == "cold_start":
                res[st] = {p: json.loads(f.read_text()) for p in a.start_policies.split(",")
                           if (f := out.with_name(f"{out.stem}_{p}.json")).exists()}
            elif out.exists():
                res[st] = json.loads(out.read_text())
            res["stage_s"][st] = time.perf_counter() - t0
            res["summary"] = summarize(res)
            emit_json(res, a.json)
    for line in _lines(res["summary"]):
        print(line, file=sys.stderr)
    return res


def _lines(s: dict) -> list[str]:
    out = []
    for name, v in s.get("batch1_act_ms", {}).items():
        out.append(f"{name}: batch-1 act p50 {v['p50']:.2f} ms (target {v['target']}: {_met(v['met'])})")
    for name, v in s.get("share_of_peak", {}).items():
        out.append(f"{name}: {v['actors']} actors at {v['mfu']:.0%} of the matmul peak "
                   f"(target {v['target']}: {_met(v['met'])})")
    for name, by in s.get("train_serve", {}).items():
        for load, modes in by.items():
            for mode, v in modes.items():
                extra = "".join(f", {label} {v[k]:.2f}" for k, label in (("window_share_both", "window share"),
                                                                         ("sims_ratio", "beside the simulators"))
                                if k in v)
                out.append(f"{name}, {load}, {mode}: updates {v['update_ratio']:.2f}x, act p99 "
                           f"{v['act_p99_ratio']:.2f}x ({_met(v['met'])}){extra}")
    for name, v in s.get("start_s", {}).items():
        cases = ", ".join(f"{c} {t:.1f} s" for c, t in v["to_serving_s"].items())
        out.append(f"{name}: to serving {cases} (with artefacts, target {v['target_artefacts_s']:.0f} s: "
                   f"{_met(v['met'])})")
    return out


def _met(m) -> str:
    return "no target" if m is None else ("met" if m else "MISSED")


if __name__ == "__main__":
    main()
