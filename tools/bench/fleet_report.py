"""The fleet bench's figures (:mod:`tools.bench.fleet`): one point per (load, N), what
saturates first, and the plot of N against latency, throughput and CPU."""

from __future__ import annotations

import os

import numpy as np

from tools.bench.common import percentile
from tools.bench.fleet_gpu import title

#: an actor kept its rate when it made this share of its steps in the window
KEPT = 0.95
#: a thread (or process) at this share of a core or more counts as saturated
BUSY = 0.85


def _pct(xs, q) -> float | None:
    return round(percentile(xs, q), 3) if len(xs) else None


def _delta(a: dict, b: dict, key: str) -> float:
    return float(b.get(key, 0) or 0) - float(a.get(key, 0) or 0)


def summarize(*, load: str, n: int, hz: float, chunk: int, batch_records: int, robots: list[dict], window_s: float,
              cpu: dict, status: tuple[dict, dict, dict], peak_rss: dict) -> dict:
    """The figures of one run of N robots (``robots``: :meth:`SimActor.result` of each)."""
    st_a, st_b, final = status
    lat = np.concatenate([np.asarray(r["lat_ms"], float) for r in robots]) if robots else np.zeros(0)
    per = [np.asarray(r["lat_ms"], float) for r in robots if len(r["lat_ms"]) >= 3]
    p50s = [percentile(x, 50) for x in per]
    p99s = [percentile(x, 99) for x in per]
    rates = np.asarray([r["window_steps"] / window_s for r in robots], float)
    records = sum(r["records"] for r in robots)
    nbytes = sum(r["bytes"] for r in robots)
    dt = max(1e-9, float(st_b.get("_mtime", 0)) - float(st_a.get("_mtime", 0)))
    batches = _delta(st_a, st_b, "infer_batches")
    rec_s = _delta(st_a, st_b, "stored") / dt
    bpr = nbytes / records if records else 0.0
    py_names = {*st_a.get("threads", {}).values(), *st_b.get("threads", {}).values(),
                *final.get("threads", {}).values()}
    threads = cpu["learner_threads"]
    ids = {r["actor"] for r in robots}  # (a shared learner also lists the last N's robots)
    server_p50 = [r["act_p50_ms"] for r in st_b.get("actors_table", [])
                  if r.get("act_p50_ms") is not None and r.get("actor") in ids]
    return {
        "load": load, "actors": n, "cpus": os.cpu_count(), "hz": hz, "chunk": chunk, "window_s": round(window_s, 2),
        "act_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "max": _pct(lat, 100), "n": int(len(lat))},
        "act_ms_per_actor": {"p50_median": _pct(p50s, 50), "p50_max": _pct(p50s, 100),
                             "p99_median": _pct(p99s, 50), "p99_max": _pct(p99s, 100)},
        "server_act_p50_ms_median": _pct(server_p50, 50),
        "acts_per_s": round(len(lat) / window_s, 1),
        "offered_acts_per_s": round(n * hz / chunk, 1),
        "rate": {"target_hz": hz, "median_hz": _pct(rates, 50), "min_hz": _pct(rates, 0),
                 "kept_fraction": float(np.mean(rates >= KEPT * hz)) if len(rates) else 0.0,
                 "late_steps": sum(r["late_steps"] for r in robots)},
        "act_failures": sum(r["act_failures"] for r in robots),
        "reconnects": sum(r["reconnects"] for r in robots),
        "infer_batch": round(_delta(st_a, st_b, "served") / batches, 2) if batches > 0 else 0.0,
        "infer_batches_per_s": round(batches / dt, 1),
        "ingest": {"records_per_s": round(rec_s, 1), "mb_per_s": round(rec_s * bpr / 1e6, 3),
                   "offered_records_per_s": round(n * hz, 1), "bytes_per_record": round(bpr),
                   "messages_per_s": round(rec_s / max(1, batch_records), 1)},
        "acks": {"records": records, "acked": sum(r["acked"] for r in robots),
                 "pending_at_end": sum(r["pending"] for r in robots),
                 "all_acked": all(r["pending"] == 0 for r in robots) and records > 0},
        "cpu_cores": {**cpu, "learner_python_threads": round(sum(v for k, v in threads.items() if k in py_names), 3)},
        "peak_rss_mb": {k: round(v, 1) for k, v in peak_rss.items()},
        "learner": {k: final.get(k) for k in ("rejected", "internal_errors", "dropped_episodes", "rejections",
                                               "dataset_pending", "staged_mb", "duplicates", "wire_gate",
                                               "served", "superseded_acts")},
        "errors": [r["error"] for r in robots if r["error"]][:5],
    }


def limits(p: dict) -> list[tuple[str, float]]:
    """(resource, share of its capacity) of one point, busiest first: each learner thread and
    the sum of its Python threads (one GIL: at most one core between them), the wire gate, the
    encoder workers (their count's cores), the busiest robot process (one GIL: the harness,
    not the learner, when it is full), the learner's GPU (the share of time a kernel ran,
    nvidia-smi) where it has one, and the whole machine."""
    c = p["cpu_cores"]
    out = [(f"learner thread {k}", v) for k, v in c["learner_threads"].items()]
    out.append(("learner Python threads together (GIL)", c["learner_python_threads"]))
    for k, v in c["learner_children"].items():
        out.append((k, v / (2.0 if k == "encoder-workers" else 1.0)))
    if "robots_max_process" in c:
        out.append(("one robot process (harness, GIL)", c["robots_max_process"]))
    if p.get("gpu"):
        out.append(("GPU busy (nvidia-smi utilization)", p["gpu"]["util_pct_mean"] / 100.0))
    cpus = max(1, int(round(p.get("cpus", 2))))
    out.append(("machine CPU (learner + robots + other work)", c["machine_busy_cores"] / cpus))
    return sorted(out, key=lambda kv: -kv[1])


def verdict(points: list[dict]) -> dict:
    """Per load: the largest N whose every actor kept its rate, the first N that did not, and
    the resources at or over :data:`BUSY` of their capacity there (busiest first)."""
    res = {}
    for load in sorted({p["load"] for p in points}):
        pts = sorted((p for p in points if p["load"] == load), key=lambda p: p["actors"])
        ok = [p["actors"] for p in pts if p["rate"]["kept_fraction"] >= KEPT and not p["act_failures"]]
        bad = [p for p in pts if p["rate"]["kept_fraction"] < KEPT or p["act_failures"]]
        first = bad[0] if bad else pts[-1]
        busy = [(k, round(v, 2)) for k, v in limits(first) if v >= BUSY] or \
            [(k, round(v, 2)) for k, v in limits(first)[:3]]
        inside = [(k, round(v, 2)) for k, v in limits(first) if not k.startswith(("machine", "one robot"))]
        res[load] = {"kept_rate_up_to": max(ok) if ok else None,
                     "saturated_at": bad[0]["actors"] if bad else None,
                     "busiest_at_that_point": busy,
                     "busiest_inside_the_learner": inside[:4],
                     "note": "saturated within the tested N" if bad else
                             f"not saturated up to N={pts[-1]['actors']}: busiest resources listed"}
    return res


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    """Per (load, N): the before and after figures side by side."""
    rows = []
    for b in before:
        a = next((p for p in after if (p["load"], p["actors"]) == (b["load"], b["actors"])), None)
        if a is None:
            continue
        row = {"load": b["load"], "actors": b["actors"]}
        for name, get in (("act_p50_ms", lambda p: p["act_ms"]["p50"]), ("act_p99_ms", lambda p: p["act_ms"]["p99"]),
                          ("kept_fraction", lambda p: p["rate"]["kept_fraction"]),
                          ("median_hz", lambda p: p["rate"]["median_hz"]),
                          ("ingest_records_per_s", lambda p: p["ingest"]["records_per_s"]),
                          ("pending_at_end", lambda p: p["acks"]["pending_at_end"]),
                          ("dataset_pending", lambda p: p["learner"]["dataset_pending"]),
                          ("learner_cores", lambda p: round(sum(p["cpu_cores"]["learner_threads"].values()), 3)),
                          ("load_avg_before", lambda p: p["load_avg_before"][0])):
            row[name] = [get(b), get(a)]
        rows.append(row)
    return rows


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = out["points"]
    loads = sorted({p["load"] for p in pts})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"state": "tab:blue", "camera": "tab:orange"}
    for load in loads:
        ps = sorted((p for p in pts if p["load"] == load), key=lambda p: p["actors"])
        n = [p["actors"] for p in ps]
        c = colors.get(load, None)
        axes[0].plot(n, [p["act_ms"]["p50"] for p in ps], "o-", color=c, label=f"{load} p50")
        axes[0].plot(n, [p["act_ms"]["p99"] for p in ps], "s--", color=c, label=f"{load} p99")
        axes[1].plot(n, [p["acts_per_s"] for p in ps], "o-", color=c, label=f"{load} acts/s")
        axes[1].plot(n, [p["offered_acts_per_s"] for p in ps], ":", color=c, alpha=0.6)
        axes[1].plot(n, [p["ingest"]["records_per_s"] for p in ps], "s--", color=c, label=f"{load} records/s")
        axes[1].plot(n, [p["ingest"]["offered_records_per_s"] for p in ps], ":", color=c, alpha=0.6)
        top = sorted({k for p in ps for k in list(p["cpu_cores"]["learner_threads"])[:2]})
        for k in top:
            axes[2].plot(n, [p["cpu_cores"]["learner_threads"].get(k, 0) for p in ps], "o-", alpha=0.8,
                         label=f"{load}: {k}")
        gate = [p["cpu_cores"]["learner_children"].get("wire-gate", 0) for p in ps]
        axes[2].plot(n, gate, "^--", label=f"{load}: wire gate")
        enc = [p["cpu_cores"]["learner_children"].get("encoder-workers", 0) for p in ps]
        if any(enc):
            axes[2].plot(n, enc, "v--", label=f"{load}: video encoders")
        axes[2].plot(n, [p["cpu_cores"]["robots"] for p in ps], "x:", label=f"{load}: robots (harness)")
        if any(p.get("gpu") for p in ps):
            axes[2].plot(n, [(p.get("gpu") or {}).get("util_pct_mean", 0) / 100.0 for p in ps], "D-", color=c,
                         label=f"{load}: GPU busy (share)")
    for load in loads if "before" in out else ():  # the same points with the base learner
        ps = sorted((p for p in out["before"]["points"] if p["load"] == load), key=lambda p: p["actors"])
        axes[0].plot([p["actors"] for p in ps], [p["act_ms"]["p50"] for p in ps], "o:", color=colors.get(load),
                     alpha=0.35, label=f"{load} p50, before")
        axes[1].plot([p["actors"] for p in ps], [p["ingest"]["records_per_s"] for p in ps], "s:",
                     color=colors.get(load), alpha=0.35, label=f"{load} records/s, before")
    axes[0].set(xscale="log", yscale="log", xlabel="robots N", ylabel="act latency (ms)",
                title="act latency, all acts")
    axes[1].set(xscale="log", yscale="log", xlabel="robots N", ylabel="per second",
                title="served acts and ingested records (dotted: offered)")
    axes[2].set(xscale="log", xlabel="robots N", ylabel="cores", title="CPU: busiest learner threads")
    ticks = sorted({p["actors"] for p in pts})
    for ax in axes:
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Tandem fleet bench · {out['date']} · {title(out)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
