"""Part (a) of the transport bench: act round-trip latency, Tandem against raw REQ/REP, in
interleaved (ABBA) rounds, with Tandem's stage split from the stack's timestamps."""

from __future__ import annotations

from typing import Any

import numpy as np

from tools.bench.common import bootstrap_ratio_ci, ci_fields, median, percentile
from tools.bench.transport_client import WorkerHandle
from tools.bench.transport_server import Meter, TandemStack, add_threads, per_unit


def bench_act(cfg: dict, worker: WorkerHandle, stack: TandemStack) -> dict:
    n, rounds = cfg["act_iters"], cfg["act_rounds"]
    for kind in ("raw", "tandem"):
        worker.call("act", kind=kind, n=cfg["act_warmup"])
    per: dict[str, list[dict]] = {"raw": [], "tandem": []}
    thread_acc: dict[str, dict[str, float]] = {"raw": {}, "tandem": {}}
    stages: dict[str, list[float]] = {}
    samples: dict[str, list[np.ndarray]] = {"raw": [], "tandem": []}  # every call's latency, us
    for r in range(rounds):
        for kind in (("raw", "tandem") if r % 2 == 0 else ("tandem", "raw")):
            stack.clear_marks()
            meter = Meter(worker)
            res = worker.call("act", kind=kind, n=n)
            cpu, threads = meter.stop()
            add_threads(thread_acc[kind], threads)
            lat = (res["t1"] - res["t0"]) * 1e6
            samples[kind].append(lat)
            per[kind].append({"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
                              "mean_us": float(lat.mean()), "cpu_us": cpu * 1e6 / n})
            if kind == "tandem" and len(stack.t_recv) == len(stack.policy.t_act) == len(stack.t_reply) == n:
                t_recv, t_act, t_reply = (np.asarray(v) for v in
                                          (stack.t_recv, stack.policy.t_act, stack.t_reply))
                for name, d in (
                    ("client act() -> service validated, queued", t_recv - res["t0"]),
                    ("queue -> inference thread at policy.act", t_act - t_recv),
                    ("policy.act + .numpy() + reply encode", t_reply - t_act),
                    ("outbox -> service -> ROUTER -> client returns", res["t1"] - t_reply),
                ):
                    stages.setdefault(name, []).append(percentile(d * 1e6, 50))
    out: dict[str, Any] = {"rounds": per}
    for kind in ("raw", "tandem"):
        for key in ("p50_us", "p99_us", "mean_us", "cpu_us"):
            out[f"{kind}_{key}"] = median([x[key] for x in per[kind]])
    out["act_overhead_ratio"] = out["tandem_p50_us"] / out["raw_p50_us"]
    out["act_overhead_ratio_paired"] = median(
        [t["p50_us"] / r["p50_us"] for t, r in zip(per["tandem"], per["raw"])])
    out["tandem_stage_p50_us"] = {k: median(v) for k, v in stages.items()}
    # 95% intervals: of each p50 over every call of every round, and of the ratio (bootstrap)
    pooled = {k: np.concatenate(v) for k, v in samples.items()}
    for kind in ("raw", "tandem"):
        out[f"{kind}_p50_ci"] = ci_fields(pooled[kind])
    # the interval is of the pooled ratio (every call of every round), which it brackets;
    # act_overhead_ratio (median of per-round p50s) is usually close to it
    out["act_overhead_ratio_pooled"] = float(np.median(pooled["tandem"]) / np.median(pooled["raw"]))
    out["act_overhead_ratio_ci95"] = bootstrap_ratio_ci(pooled["tandem"], pooled["raw"], reps=500)
    out["cpu_us_per_call_by_thread"] = {k: per_unit(v, n * rounds, 1e6) for k, v in thread_acc.items()}
    return out
