"""The transport bench's output: the flat JSON summary and the human-readable report."""

from __future__ import annotations

import sys
from typing import Any

from tools.bench.common import CI_REL_TARGET

TARGET_ACT_RATIO = 1.3
TARGET_INGEST_RATIO = 0.8


def summary(cfg: dict, result: dict) -> dict:
    """The flat JSON object: ratios, raw figures, config."""
    out: dict[str, Any] = {}
    if "act" in result:
        a = result["act"]
        out.update(
            act_overhead_ratio=a["act_overhead_ratio"],
            act_overhead_ratio_paired=a["act_overhead_ratio_paired"],
            act_raw_p50_us=a["raw_p50_us"], act_raw_p99_us=a["raw_p99_us"],
            act_tandem_p50_us=a["tandem_p50_us"], act_tandem_p99_us=a["tandem_p99_us"],
            act_raw_cpu_us=a["raw_cpu_us"], act_tandem_cpu_us=a["tandem_cpu_us"],
            act_tandem_stage_p50_us=a["tandem_stage_p50_us"],
            act_rounds={k: [x["p50_us"] for x in v] for k, v in a["rounds"].items()},
            act_cpu_us_per_call_by_thread=a["cpu_us_per_call_by_thread"],
            act_overhead_ratio_ci95=a["act_overhead_ratio_ci95"],
            act_overhead_ratio_pooled=a["act_overhead_ratio_pooled"],
            act_raw_p50_ci=a["raw_p50_ci"], act_tandem_p50_ci=a["tandem_p50_ci"],
        )
    if "ingest" in result:
        g = result["ingest"]
        out.update(
            ingest_ratio=g["ingest_ratio"], ingest_ratio_paired=g["ingest_ratio_paired"],
            ingest_raw_mb_s=g["raw_mb_s"], ingest_tandem_mb_s=g["tandem_mb_s"],
            ingest_raw_cpu_ms_per_mb=g["raw_cpu_ms_per_mb"],
            ingest_tandem_cpu_ms_per_mb=g["tandem_cpu_ms_per_mb"],
            ingest_rounds={k: [x["mb_s"] for x in v] for k, v in g["rounds"].items()},
            ingest_cpu_ms_per_mb_by_thread=g["cpu_ms_per_mb_by_thread"],
            ingest_batch_payload_bytes=g["batch_payload_bytes"],
            spool_append_mb_s=g["spool_append_mb_s"], records_stored=g["records_stored"],
            rejected=g["rejected"],
            ingest_ratio_ci95=g["ingest_ratio_ci95"],
            ingest_raw_mb_s_ci=g["raw_mb_s_ci"], ingest_tandem_mb_s_ci=g["tandem_mb_s_ci"],
        )
    out["targets"] = {"act_overhead_ratio_max": TARGET_ACT_RATIO, "ingest_ratio_min": TARGET_INGEST_RATIO}
    if "act_overhead_ratio" in out:
        out["act_ok"] = out["act_overhead_ratio"] <= TARGET_ACT_RATIO
    if "ingest_ratio" in out:
        out["ingest_ok"] = out["ingest_ratio"] >= TARGET_INGEST_RATIO
    out["warnings"] = _warnings(out)
    out["load_avg"] = result.get("load_avg")
    out["config"] = {k: v for k, v in cfg.items() if k != "json"}
    out["notes"] = [
        f"spool fsync {'ON' if cfg['spool_fsync'] else 'disabled'}; spool filled before each timed round",
        f"replay buffer {'cold (pages faulted in during the run)' if cfg['cold_buffer'] else 'pre-faulted'}",
        "cpu figures: CPU time of both processes (all threads but the bench driver's) per act call / per MB",
        "client side in " + ("a thread of the server process" if cfg["client_in_process"]
                             else "a separate process"),
        "MB = 1e6 bytes of message frames (header + arrays); medians over interleaved rounds",
    ]
    if "profile" in result:
        out["profile"] = {k: v for k, v in result["profile"].items() if "cprofile" not in k}
    return out


def _warnings(s: dict) -> list[str]:
    """Figures whose 95% interval of the median is missing or wider than +/-5%."""
    out = []
    for key in ("act_raw_p50_ci", "act_tandem_p50_ci", "ingest_raw_mb_s_ci", "ingest_tandem_mb_s_ci"):
        ci = s.get(key)
        if ci is None:
            continue
        if ci["ci_rel"] is None:
            out.append(f"{key[:-3]}: too few samples for a 95% interval of the median (more rounds)")
        elif ci["ci_rel"] > CI_REL_TARGET:
            out.append(f"{key[:-3]}: 95% interval {ci['ci95'][0]:.4g}..{ci['ci95'][1]:.4g} is "
                       f"+/-{ci['ci_rel']:.1%}, wider than +/-{CI_REL_TARGET:.0%}: noisy")
    for w in out:
        print("WARNING:", w, file=sys.stderr, flush=True)
    return out


def _ci(ci: list[float] | None) -> str:
    return "no interval" if ci is None else f"95% {ci[0]:.2f}-{ci[1]:.2f}"


def _pairs(rounds: dict[str, list[dict]], key: str) -> str:
    return ", ".join(f"{r[key]:.0f}/{t[key]:.0f}" for r, t in zip(rounds["raw"], rounds["tandem"]))


def print_report(cfg: dict, result: dict, s: dict) -> None:
    w = sys.stdout.write
    where = "in-process thread" if cfg["client_in_process"] else "in a separate process"
    load = s["load_avg"]
    w(f"Tandem transport bench (loopback; client {where};"
      f" load avg {load['start']:.2f} -> {load['end']:.2f})\n")
    if "act" in result:
        a = result["act"]
        img, sd = cfg["act_image"], cfg["state_dim"]
        w(f"\n(a) act round trip: {img}x{img}x3 uint8 + float32[{sd}]"
          f" -> float32[{cfg['chunk']}x{cfg['action_dim']}];"
          f" {cfg['act_rounds']} rounds x {cfg['act_iters']} (warm-up {cfg['act_warmup']})\n")
        for label, k in (("raw REQ/REP ", "raw"), ("Tandem act()", "tandem")):
            w(f"    {label}  p50 {a[k + '_p50_us']:8.1f} us   p99 {a[k + '_p99_us']:8.1f} us"
              f"   CPU {a[k + '_cpu_us']:7.1f} us/call\n")
        ok = "OK" if a["act_overhead_ratio"] <= TARGET_ACT_RATIO else "MISSES"
        w(f"    act_overhead_ratio = {a['act_overhead_ratio']:.2f}"
          f" ({_ci(a['act_overhead_ratio_ci95'])}; paired median {a['act_overhead_ratio_paired']:.2f});"
          f" target <= {TARGET_ACT_RATIO}: {ok}\n")
        w(f"    per-round p50 raw / tandem: {_pairs(a['rounds'], 'p50_us')}\n")
        for kind, d in a["cpu_us_per_call_by_thread"].items():
            w(f"    CPU us/call by thread, {kind}: " + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + "\n")
        if a["tandem_stage_p50_us"]:
            w("    Tandem stages (median of per-round p50, us):\n")
            for k, v in a["tandem_stage_p50_us"].items():
                w(f"      {v:8.1f}  {k}\n")
    if "ingest" in result:
        g = result["ingest"]
        img = cfg["ingest_image"]
        w(f"\n(b) transition ingest: batches of {cfg['batch_records']} records x {cfg['cameras']} cameras"
          f" {img}x{img}x3 + state ({g['batch_payload_bytes'] / 1e6:.2f} MB/batch);"
          f" {cfg['ingest_rounds']} rounds x {cfg['ingest_batches']} batches;"
          f" max_in_flight {cfg['max_in_flight']}; spool fsync {'on' if cfg['spool_fsync'] else 'OFF'};"
          f" replay buffer {'cold' if cfg['cold_buffer'] else 'pre-faulted'}\n")
        for label, k in (("raw PUSH/PULL    ", "raw"), ("Tandem spool->ack", "tandem")):
            w(f"    {label}      {g[k + '_mb_s']:8.1f} MB/s   CPU {g[k + '_cpu_ms_per_mb']:6.2f} ms/MB\n")
        ok = "OK" if g["ingest_ratio"] >= TARGET_INGEST_RATIO else "MISSES"
        w(f"    ingest_ratio = {g['ingest_ratio']:.2f} ({_ci(g['ingest_ratio_ci95'])}; paired median"
          f" {g['ingest_ratio_paired']:.2f});"
          f" target >= {TARGET_INGEST_RATIO}: {ok}\n")
        w(f"    per-round MB/s raw / tandem: {_pairs(g['rounds'], 'mb_s')}\n")
        for kind, d in g["cpu_ms_per_mb_by_thread"].items():
            w(f"    CPU ms/MB by thread, {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) + "\n")
        w(f"    (spool append, untimed above: {g['spool_append_mb_s']:.0f} MB/s; stored {g['records_stored']}"
          f" records, rejected {g['rejected']})\n")
    if "profile" in result:
        p = result["profile"]
        w("\n--- profile: stage timers (Tandem only, this process; wall time inside each call) ---\n")
        w(f"ingest: {p['ingest_timed_round_mb_s']:.0f} MB/s with timers,"
          f" wall {p['ingest_wall_us_per_batch']:.0f} us/batch\n")
        for k, v in p["ingest_stages_per_batch"].items():
            w(f"  {v['us_per_unit']:9.1f} us/batch  {k}  ({v['calls']} calls)\n")
        w(f"act: wall p50 {p['act_wall_us_per_call']:.0f} us/call with timers\n")
        for k, v in p["act_stages_per_call"].items():
            w(f"  {v['us_per_unit']:9.1f} us/call   {k}  ({v['calls']} calls)\n")
        for key in ("ingest_cprofile_server", "ingest_cprofile_client",
                    "act_cprofile_server", "act_cprofile_client"):
            if p.get(key):
                w(f"\n--- cProfile {key} (by tottime) ---\n{p[key]}")
