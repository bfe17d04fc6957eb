"""Part (b) of the transport bench: transition ingest throughput, Tandem's spool -> service ->
replay buffer stream with acks against raw PUSH/PULL of the same frames, interleaved rounds."""

from __future__ import annotations

from typing import Any

from tools.bench.common import bootstrap_ratio_ci, ci_fields, median
from tools.bench.raw_zmq import RawSink
from tools.bench.transport_client import WorkerHandle
from tools.bench.transport_data import INGEST_ACTOR
from tools.bench.transport_server import Meter, TandemStack, add_threads, per_unit


def ingest_round_tandem(worker: WorkerHandle, stack: TandemStack, fill: dict, profile=False) -> dict:
    meter = Meter(worker)
    res = worker.call("ingest_tandem", profile=profile)
    cpu, threads = meter.stop()
    got = stack.ingest.received.get(INGEST_ACTOR, -1)
    if got != fill["last_seq"]:
        raise RuntimeError(f"learner stored up to seq {got}, expected {fill['last_seq']}")
    dt = res["t1"] - res["t0"]
    return {"mb_s": fill["payload"] / dt / 1e6, "seconds": dt, "payload": fill["payload"],
            "cpu_ms_per_mb": cpu * 1e3 / (fill["payload"] / 1e6), "threads": threads,
            "profile": res.get("profile")}


def ingest_round_raw(worker: WorkerHandle, sink: RawSink, n: int) -> dict:
    worker.call("prepare_raw", n=n)
    sink.reset(n)
    meter = Meter(worker)
    res = worker.call("ingest_raw")
    if not sink.done.wait(120):
        raise TimeoutError("raw sink did not receive every message")
    cpu, threads = meter.stop()
    if sink.nbytes != res["payload"]:
        raise RuntimeError(f"raw sink got {sink.nbytes} bytes, sender sent {res['payload']}")
    dt = sink.t_last - res["t0"]
    return {"mb_s": res["payload"] / dt / 1e6, "seconds": dt, "payload": res["payload"],
            "cpu_ms_per_mb": cpu * 1e3 / (res["payload"] / 1e6), "threads": threads}


def bench_ingest(cfg: dict, worker: WorkerHandle, stack: TandemStack, sink: RawSink) -> dict:
    n, rounds = cfg["ingest_batches"], cfg["ingest_rounds"]
    fill = worker.call("fill", n=cfg["ingest_warmup_batches"])
    ingest_round_tandem(worker, stack, fill)
    ingest_round_raw(worker, sink, cfg["ingest_warmup_batches"])
    per: dict[str, list[dict]] = {"raw": [], "tandem": []}
    append_mb_s = []
    for r in range(rounds):
        fill = worker.call("fill", n=n)
        append_mb_s.append(fill["payload"] / fill["append_s"] / 1e6)
        for kind in (("raw", "tandem") if r % 2 == 0 else ("tandem", "raw")):
            if kind == "tandem":
                res = ingest_round_tandem(worker, stack, fill)
                res.pop("profile", None)
            else:
                res = ingest_round_raw(worker, sink, n)
            per[kind].append(res)
    out: dict[str, Any] = {"rounds": per}
    by_thread = {}
    for kind in ("raw", "tandem"):
        acc: dict[str, float] = {}
        for x in per[kind]:
            add_threads(acc, x.pop("threads"))
        by_thread[kind] = per_unit(acc, sum(x["payload"] for x in per[kind]) / 1e6, 1e3)
    out["cpu_ms_per_mb_by_thread"] = by_thread
    for kind in ("raw", "tandem"):
        out[f"{kind}_mb_s"] = median([x["mb_s"] for x in per[kind]])
        out[f"{kind}_cpu_ms_per_mb"] = median([x["cpu_ms_per_mb"] for x in per[kind]])
    out["ingest_ratio"] = out["tandem_mb_s"] / out["raw_mb_s"]
    out["ingest_ratio_paired"] = median([t["mb_s"] / r["mb_s"] for t, r in zip(per["tandem"], per["raw"])])
    # intervals over rounds (each round one throughput sample)
    for kind in ("raw", "tandem"):
        out[f"{kind}_mb_s_ci"] = ci_fields([x["mb_s"] for x in per[kind]])
    out["ingest_ratio_ci95"] = bootstrap_ratio_ci([x["mb_s"] for x in per["tandem"]],
                                                  [x["mb_s"] for x in per["raw"]])
    out["batch_payload_bytes"] = per["tandem"][0]["payload"] // n if per["tandem"] else 0
    out["spool_append_mb_s"] = median(append_mb_s)
    out["records_stored"] = stack.buffer.total_added
    out["rejected"] = stack.service.counters["rejected"]
    return out
