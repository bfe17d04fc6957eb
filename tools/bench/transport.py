"""Transport benchmark: Tandem's act and transition-ingest paths against raw pyzmq.

Everything runs on loopback with ports picked by the OS (bind to port 0).

(a) **act round trip**: a real :class:`learner.service.LearnerService` and
    :class:`learner.inference.InferenceServer` (with a policy whose ``act()`` returns zeros of
    the right shape at once, so the figure is transport overhead, not model time) answering a
    real :meth:`actor.client.LearnerClient.act` (through the learner's act socket, served by the
    inference thread: :mod:`learner.act_channel`) with a 224x224x3 uint8 image plus a small float32
    state. Baseline: raw pyzmq REQ/REP carrying the same bytes (a frame of image bytes and a
    frame of state bytes) and replying with as many bytes as Tandem's action chunk.
    ``act_overhead_ratio = tandem_p50 / raw_p50``.

(b) **transition ingest**: a real LearnerClient streams TransitionBatch messages from its on-disk
    :class:`actor.spool.Spool` (fsync disabled unless ``--spool-fsync``; the spool is filled
    before each timed round, outside the timing, and its append rate is reported separately) to
    LearnerService -> validate -> Ingest -> ReplayBuffer with acks (``max_in_flight`` window).
    The replay buffer's pages are faulted in first (steady state of a buffer that has wrapped;
    ``--cold-buffer`` measures a fresh one). Baseline: raw pyzmq PUSH/PULL, no acks, of the same
    encoded frames, each message prepared (untimed) in its own memory laid out as a spool blob.
    ``ingest_ratio = tandem_MB_s / raw_MB_s`` (payload = the message frames' bytes, MB = 1e6 B).

Method: the server side (Tandem stacks and raw servers) runs in this process, the client side
(LearnerClients, raw REQ/PUSH) in a spawned child process (``--client-in-process`` puts it in a
thread here instead), each side with its own ZMQ context, as an actor and a learner would be.
Raw and Tandem rounds are interleaved (ABBA order) after warm-up, and the reported figures are
medians over rounds; cross-process stage timestamps use ``time.perf_counter`` (CLOCK_MONOTONIC).
The only additions to the product path are list appends recording timestamps in the
``submit_act``/``reply`` callables the bench hands to the service and inference threads.

Besides wall-clock figures it reports the CPU time both processes spent (per act call, per MB),
by thread, from /proc/<pid>/task/<tid>/schedstat: on a CPU-starved machine throughput follows
CPU cost, and the per-thread split shows which side and stage pays it.

``--profile`` adds two Tandem-only passes after the measurement: one with per-stage timers
(monkeypatched wrappers, this process only) and one under cProfile (server process: Python 3.12's
cProfile sees every thread; client process: its own profile).

Usage::

    python -m tools.bench.transport                 # human-readable report
    python -m tools.bench.transport --json          # exactly one JSON object on stdout
    python -m tools.bench.transport --profile --act-rounds 3 --ingest-rounds 3
    python -m tools.bench.transport --quick --json  # a few seconds (smoke; rough figures)

Intervals: ``act_*_p50_ci`` is the 95% interval of each p50 over every call (order statistics),
``act_overhead_ratio_ci95`` a bootstrap interval of the ratio; ingest's are over rounds (one
MB/s per round; 6+ rounds needed). Figures whose interval is wider than +/-5% are listed in
``warnings`` (and on stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

import zmq

from tools.bench.common import emit_json, quiet_logging
from tools.bench.procstat import prefault
from tools.bench.raw_zmq import RawRep, RawSink
from tools.bench.transport_act import bench_act
from tools.bench.transport_client import WorkerHandle
from tools.bench.transport_data import act_spec, ingest_spec, spec_hash
from tools.bench.transport_ingest import bench_ingest
from tools.bench.transport_profile import bench_profile
from tools.bench.transport_report import print_report, summary
from tools.bench.transport_server import SERVER_LABELS, TandemStack


def run_bench(cfg: dict) -> dict:
    quiet_logging()
    logging.getLogger("tandem").setLevel(logging.WARNING)
    load0 = os.getloadavg()
    tmpdir = tempfile.mkdtemp(prefix="tandem-bench-")
    stacks: list[TandemStack] = []
    raw_ctx = zmq.Context()
    raw_threads: list[threading.Thread] = []
    worker = None
    try:
        a_spec, i_spec = act_spec(cfg), ingest_spec(cfg)
        act_stack = TandemStack(a_spec, spec_hash(a_spec, cfg), cfg, buffer_capacity=2)
        ing_stack = TandemStack(i_spec, spec_hash(i_spec, cfg), cfg, buffer_capacity=cfg["buffer_capacity"])
        if not cfg["cold_buffer"]:
            # np.zeros maps pages lazily: the first write to each page of the ring faults it in
            # (slow on a VM whose memory was never touched). Fault them in now, so that the
            # figures are the steady state of a buffer that has wrapped; --cold-buffer measures
            # a fresh one.
            prefault(ing_stack.buffer)
        stacks += [act_stack, ing_stack]
        rep = RawRep(raw_ctx, b"\0" * (cfg["chunk"] * cfg["action_dim"] * 4))
        sink = RawSink(raw_ctx)
        raw_threads += [rep, sink]
        for t in raw_threads:
            t.start()
        SERVER_LABELS.clear()
        SERVER_LABELS.update({
            act_stack.service.native_id: "act:service", act_stack.inference.native_id: "act:inference",
            ing_stack.service.native_id: "ingest:service", ing_stack.inference.native_id: "ingest:inference",
            rep.native_id: "raw-rep", sink.native_id: "raw-sink", threading.get_native_id(): "server-main",
        })
        ports = {"tandem_act": act_stack.service.port, "tandem_ingest": ing_stack.service.port,
                 "raw_act": rep.port, "raw_ingest": sink.port}
        worker = WorkerHandle(cfg, ports, tmpdir, cfg["client_in_process"])
        result: dict[str, Any] = {}
        if cfg["act_rounds"] > 0:
            result["act"] = bench_act(cfg, worker, act_stack)
        if cfg["ingest_rounds"] > 0:
            result["ingest"] = bench_ingest(cfg, worker, ing_stack, sink)
        if cfg["profile"]:
            result["profile"] = bench_profile(cfg, worker, act_stack, ing_stack)
        result["load_avg"] = {"start": load0[0], "end": os.getloadavg()[0]}
        return result
    finally:
        if worker is not None:
            worker.stop()
        for t in raw_threads:
            t.stop_event.set()
            t.join(timeout=2)
        raw_ctx.destroy(linger=0)
        for s in stacks:
            s.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


#: --quick: enough samples for intervals (6 rounds), small payloads
QUICK = dict(act_iters=40, act_warmup=10, act_rounds=2, act_image=64, ingest_batches=3, ingest_rounds=6,
             ingest_warmup_batches=1, batch_records=4, ingest_image=32, buffer_capacity=256)


def parse_args(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--act-iters", type=int, default=500, help="act calls per round")
    ap.add_argument("--act-warmup", type=int, default=200, help="warm-up act calls (each path)")
    ap.add_argument("--act-rounds", type=int, default=5, help="interleaved rounds (0 skips part a)")
    ap.add_argument("--act-image", type=int, default=224)
    ap.add_argument("--ingest-batches", type=int, default=24, help="batches per round")
    ap.add_argument("--ingest-rounds", type=int, default=8,
                    help="interleaved rounds (0 skips part b; 6 or more for a 95%% interval)")
    ap.add_argument("--ingest-warmup-batches", type=int, default=4)
    ap.add_argument("--batch-records", type=int, default=32)
    ap.add_argument("--cameras", type=int, default=2)
    ap.add_argument("--ingest-image", type=int, default=128)
    ap.add_argument("--state-dim", type=int, default=8)
    ap.add_argument("--action-dim", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=10, help="action chunk length H of the act reply")
    ap.add_argument("--buffer-capacity", type=int, default=2048, help="replay buffer records")
    ap.add_argument("--max-in-flight", type=int, default=16, help="LearnerClient in-flight batches")
    ap.add_argument("--spool-fsync", action="store_true", help="fsync spool appends (default off)")
    ap.add_argument("--cold-buffer", action="store_true",
                    help="do not pre-fault the replay buffer's pages (measure a fresh buffer's first pass)")
    ap.add_argument("--client-in-process", action="store_true",
                    help="run the client side in a thread of this process instead of a child process")
    ap.add_argument("--quick", action="store_true",
                    help="a few seconds: small images and counts (a smoke run; figures are rough)")
    ap.add_argument("--profile", action="store_true", help="add stage-timer and cProfile passes")
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.batch_records < 2:
        ap.error("--batch-records must be >= 2")
    if min(args.act_iters, args.ingest_batches) < 1:
        ap.error("iteration counts must be >= 1")
    return {k: v for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = run_bench(cfg)
    s = summary(cfg, result)
    if cfg["json"]:
        emit_json(s)
    else:
        print_report(cfg, result, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
