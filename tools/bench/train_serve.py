"""Training while serving on one device: what each role costs the other, and where it goes.

For each policy the bench holds what the learner holds (learner/app.py): the trained policy and
a serving copy on the same device; a real loopback learner (``LearnerService`` +
``InferenceServer``) serves N actor processes running Tandem's ``LearnerClient``, and the main
thread trains as the learner's main thread does (``--update bc``: ``bc_loss``, backward, AdamW on
the trainable parameters, rejection sampling's update; ``--update grpo``: a ``GRPOAgent`` update
round; the default ``auto`` trains ``openvla_oft_discrete`` with GRPO and the others with BC; a
new version through ``WeightPublisher`` every ``--publish-every`` updates).

Phases of ``--seconds`` each, interleaved (every repeat runs serve, train and both for every
serving stream in ``--streams``, in a rotated order):

- ``serve``: the actors alone: act p50 / p99 over every request, chunks/s, mean served batch;
- ``train``: training alone: updates/s and the step's p50 / p99;
- ``both``: the two at once;
- ``train_sims`` (``sim`` loads only): training while the N simulated actors step their envs on
  random chunks with no learner (``--no-sims-phase`` leaves it out): what the simulators alone
  cost training on a shared box (their CPU, and their rendering where it runs on the GPU).

Actor loads (``--period``): ``0``, a closed loop around a simulator that takes no time (each
actor asks again the moment its reply comes: serving can fill the whole device); ``0.5``, one
chunk every 0.5 s (a robot's rate); ``sim``, closed-loop simulated actors: each actor steps its
own ``--env`` (LIBERO on the GPU box) on the policy's chunks, ``--execute`` actions of each, and
asks again only then, so the load is what that simulator on those cores makes of it.

Per policy, actor load (each its ``by_period`` entry) and stream,
the medians over the repeats give
``update_ratio`` = updates/s (both) / updates/s (train) and ``step_ratio`` = step p50 (train) /
step p50 (both) (target: the smaller >= 0.8), and
``act_p99_ratio`` = act p99 (both) / act p99 (serve) (target <= 1.3). ``sims_ratio`` = updates/s
(train_sims) / updates/s (train), and ``window_share_both``, the share of the ``both`` phase
training waited for the serving window, say how much of the update ratio each cost.

Where the time goes, per phase:

- ``gil_wait_ms``: a probe thread sleeps 0.5 ms in a loop; how far each wake-up overshoots is
  how long it waited to run again (for the GIL, or for a core when the cores are busy);
- ``cpu``: CPU seconds per second of each thread (``MainThread``: training;
  ``tandem-inference``: serving; the service's and ZMQ's threads);
- ``peak_gpu_gb`` (torch.cuda.max_memory_allocated) and the process's peak resident memory so far (``peak_rss_gb``);
- ``--trace DIR``: after the last repeat, one more ``both`` phase per policy and stream
  (``both_traced``, not part of the medians) whose first ``--trace-seconds`` of training run
  under torch.profiler (chrome JSON in DIR), summarised as GPU kernel time per stream and the
  time kernels of two streams ran at once (``overlap_s``).

    python -m tools.bench.train_serve --json runs/train_serve.json          # GPU, full size
    python -m tools.bench.train_serve --tiny --device cpu --policies pi0 --actors 2 \\
        --seconds 3 --repeats 1 --streams shared                          # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from learner.distributed import intra_op_threads
from learner.serving_window import ServingWindow
from tools.bench.common import LoopbackLearner, bench_spec, emit_json, gpu_state, median
from tools.bench.policy import build
from tools.bench.policy_actors import HASH, run_actors
from tools.bench.procstat import cpu_delta, thread_cpu
from tools.bench.train_serve_loads import SIM, env_config, execute_for, key_values, load_key, parse_loads
from tools.bench.train_serve_parts import UPDATES, GilProbe, Trainer, stream_overlap, update_for

PHASES = ("serve", "train", "both")
#: the extra phase of a ``sim`` load: training beside the simulators with no serving
SIMS_PHASE = "train_sims"


def phases_for(period, sims_phase: bool = True) -> tuple[str, ...]:
    """The phases of one load: serve, train, both, and train_sims for closed-loop simulated actors."""
    return PHASES + ((SIMS_PHASE,) if period == SIM and sims_phase else ())


def _actors_meanwhile(what: str, **run_kw):
    """``run_actors(**run_kw)`` on a thread, returned once the actors have started (with
    ``box["t_go"]``, the start): ``finish()`` joins it and returns its result, or raises naming
    ``what`` where it failed; ``done`` is set when it ends."""
    go, done, box = threading.Event(), threading.Event(), {}

    def started():
        box["t_go"] = time.perf_counter()
        go.set()

    def run():
        try:
            box["r"] = run_actors(started=started, **run_kw)
        finally:
            go.set()
            done.set()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    go.wait()

    def finish() -> dict:
        th.join()
        if "r" not in box:
            raise RuntimeError(f"{what} failed")
        return box["r"]
    return done, box, finish


def _phase(kind: str, *, learner, trainer, args, period, spec, cams, counters, sync, reset_peak,
           trace_to=None, execute: int = 0) -> dict:
    import torch

    reset_peak()
    probe = GilProbe()
    cpu0, t0 = thread_cpu(), time.perf_counter()
    probe.start()
    res: dict = {"phase": kind}
    if kind == "train":
        res["train"] = trainer.run_until(seconds=args.seconds)
    elif kind == SIMS_PHASE:  # the simulators alone beside training: no learner, no serving
        done, _, finish = _actors_meanwhile("the local simulated actors", n=args.actors, port=None,
                                            seconds=args.seconds, state_dim=spec.state_dim, cams=cams,
                                            env=args.env_cfg, execute=execute)
        res["train"] = trainer.run_until(done=done)
        res["sim"] = finish()["sim"]
    else:
        done, box, finish = _actors_meanwhile(
            "the actor processes", n=args.actors, port=learner.port, seconds=args.seconds, state_dim=spec.state_dim,
            cams=cams, counters=counters, period=0.0 if period == SIM else period,
            env=args.env_cfg if period == SIM else None, execute=execute)
        if kind == "both" and trace_to is not None:  # profiled: its figures are not timings
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                res["train"] = trainer.run_until(seconds=min(args.trace_seconds, args.seconds))
            prof.export_chrome_trace(str(trace_to))
            res["trace"] = {"file": str(trace_to), **stream_overlap(json.loads(Path(trace_to).read_text()))}
        elif kind == "both":
            res["train"] = trainer.run_until(done=done)
        r = finish()
        res["act"] = {"p50_ms": r["lat_p50_ms"], "p99_ms": r["lat_p99_ms"], "chunks_per_s": r["chunks_per_s"],
                      "mean_batch": r["mean_batch"], "p90_ms": r["lat_p90_ms"], "max_ms": r["lat_max_ms"]}
        if "sim" in r:
            res["act"]["sim"] = r["sim"]
        # the server's side of the same acts: each forward from its batch's start to its actions
        # on the host (what is left of an act's time was spent before its batch started)
        fw = [(n, ms) for t, n, ms in list(learner.inference.recent) if t >= box["t_go"]]
        if fw:
            ms = np.asarray([m for _, m in fw])
            rows = np.asarray([n for n, _ in fw])
            res["act"]["server"] = {"batches": len(fw), "forward_p50_ms": float(np.percentile(ms, 50)),
                                    "forward_p99_ms": float(np.percentile(ms, 99)), "forward_max_ms": float(ms.max()),
                                    "forward_s_per_s": float(ms.sum() / 1000.0 / args.seconds),
                                    "batch_sizes": {str(b): int(c) for b, c in zip(*np.unique(rows, return_counts=True))},
                                    # a forward's time by its batch: set beside another load's, what the
                                    # rest of the box (the simulators) cost each forward
                                    "forward_p50_ms_by_batch": {str(b): float(np.percentile(ms[rows == b], 50))
                                                                for b in np.unique(rows)}}
    wall = time.perf_counter() - t0
    res["gil_wait_ms"] = probe.finish()
    res["cpu"] = {k: round(v / wall, 3) for k, v in cpu_delta(cpu0, thread_cpu()).items()}
    sync()
    res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return res


def bench_one(name: str, args, spec, tmp: Path) -> dict:
    import torch

    from learner.weights import WeightPublisher

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    reset_peak = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    serving, _ = build(name, args.tiny, args.device, tmp / "serve", spec, overrides=args.serving_cfg)
    training, _ = build(name, args.tiny, args.device, tmp / "train", spec)
    serving.eval()
    learners, pubs, windows = {}, {}, {}
    for mode in args.streams:
        windows[mode] = window_for(mode)
        ll = LoopbackLearner(serving, spec, HASH, buffer_capacity=8, device=torch.device(args.device),
                             get_version=lambda m=mode: pubs[m].version, get_weights=lambda m=mode: pubs[m].latest(),
                             service_kw={"peer_timeout_s": 600.0},
                             inference_kw={"max_batch": 64, "batch_window_ms": args.batch_window_ms,
                                           "batch_due_ms": args.batch_due_ms, "warmup": "all",
                                           "cuda_stream": "priority" if windows[mode] is not None else mode,
                                           "window": windows[mode]})
        pubs[mode] = WeightPublisher(ll.inference.set_weights, ll.service.publish)
        pubs[mode].publish(training.trainable_state_dict(), version=1)
        ll.start()
        learners[mode] = ll
    cams = {c: list(s) for c, s in spec.cameras.items()}
    out: dict = {"runs": [], "by_period": {}}
    try:
        trainer = Trainer(training, spec, args.train_batch, pubs[args.streams[0]].publish, args.publish_every, sync,
                          update=update_for(name, args.update), minibatch=args.grpo_minibatch)
        out["update"] = trainer.update
        trainer.run_until(seconds=min(5.0, args.seconds))  # warm-up: allocator, kernels
        execute = execute_for(name, serving, args.execute)
        out["execute"] = execute
        for period in args.periods:
            for rep in range(args.repeats):
                for i, mode in enumerate(args.streams):
                    ll, trainer.publish = learners[mode], pubs[mode].publish
                    hooks = windows[mode].attach(training) if windows[mode] is not None else []
                    waited = windows[mode].stats()["waited_s"] if windows[mode] is not None else 0.0
                    phases = phases_for(period, not args.no_sims_phase)
                    k = (rep + i) % len(phases)
                    order = phases[k:] + phases[:k]
                    last = rep == args.repeats - 1
                    for kind in order + (("both_traced",) if args.trace and last else ()):
                        trace_to = None
                        if kind == "both_traced":
                            trace_to = Path(args.trace) / f"{name}_{mode}_a{args.actors}_p{load_key(period)}.json"
                            trace_to.parent.mkdir(parents=True, exist_ok=True)
                        r = _phase("both" if trace_to else kind, learner=ll, trainer=trainer, args=args,
                                   period=period, spec=spec, cams=cams, execute=execute,
                                   counters=lambda inf=ll.inference: (inf.batches, inf.served), sync=sync,
                                   reset_peak=reset_peak, trace_to=trace_to)
                        r.update(repeat=rep, stream=mode, phase=kind, period_s=period)
                        if windows[mode] is not None:  # cumulative over the mode's phases so far
                            r["window"] = windows[mode].stats()
                            r["window_phase_waited_s"] = r["window"]["waited_s"] - waited
                            waited = r["window"]["waited_s"]
                        out["runs"].append(r)
                        print(f"  {name} period {load_key(period)} rep {rep} {mode:8s} {kind:5s} " + _line(r),
                              file=sys.stderr, flush=True)
                    for h in hooks:
                        h.remove()
    finally:
        for ll in learners.values():
            ll.close()
    for period in args.periods:
        out["by_period"][load_key(period)] = {mode: summarize([r for r in out["runs"]
                                                            if r["stream"] == mode and r["period_s"] == period])
                                           for mode in args.streams}
    return out


def window_for(mode: str) -> ServingWindow | None:
    """The serving window of a ``--streams`` entry: ``window`` (the learner's default lead),
    ``window:N`` (a lead of N checkpoints); None for a plain stream setting."""
    if mode != "window" and not mode.startswith("window:"):
        return None
    lead = mode.partition(":")[2]
    if lead and not lead.isdigit():
        raise ValueError(f"--streams {mode!r}: the window's lead must be a whole number of checkpoints")
    return ServingWindow(lead=int(lead)) if lead else ServingWindow()


#: the issue's targets: training keeps >= 0.8x of its rate alone, act p99 <= 1.3x of serving alone
UPDATE_TARGET, ACT_P99_TARGET = 0.8, 1.3


def summarize(runs: list[dict]) -> dict:
    """The medians over the repeats of one policy, load and stream setting, and the ratios.

    ``update_ratio`` divides the updates per second; ``step_ratio`` divides the median step times
    (alone over both). A phase of a few steps counts one slow step (an allocator flush, a publish)
    as a whole lost update, so the targets are judged on the smaller of the two
    (``update_ratio_judged``)."""
    def med(kind, f):
        return median([f(r) for r in runs if r["phase"] == kind])
    s = {"updates_per_s_train": med("train", lambda r: r["train"]["updates_per_s"]),
         "updates_per_s_both": med("both", lambda r: r["train"]["updates_per_s"]),
         "step_p50_ms_train": med("train", lambda r: r["train"]["step_ms"]["p50"]),
         "step_p50_ms_both": med("both", lambda r: r["train"]["step_ms"]["p50"]),
         "act_p50_ms_serve": med("serve", lambda r: r["act"]["p50_ms"]),
         "act_p99_ms_serve": med("serve", lambda r: r["act"]["p99_ms"]),
         "act_p50_ms_both": med("both", lambda r: r["act"]["p50_ms"]),
         "act_p99_ms_both": med("both", lambda r: r["act"]["p99_ms"]),
         "gil_wait_p99_ms": {k: med(k, lambda r: r["gil_wait_ms"]["p99"]) for k in PHASES}}
    for kind in ("serve", "both"):  # the server's side: a forward from its batch's start
        fw = [r["act"]["server"]["forward_p99_ms"] for r in runs if r["phase"] == kind and "server" in r["act"]]
        s[f"forward_p99_ms_{kind}"] = median(fw) if fw else None
    s["update_ratio"] = s["updates_per_s_both"] / s["updates_per_s_train"]
    s["step_ratio"] = s["step_p50_ms_train"] / s["step_p50_ms_both"]
    s["act_p99_ratio"] = s["act_p99_ms_both"] / s["act_p99_ms_serve"]
    s["update_ratio_judged"] = min(s["update_ratio"], s["step_ratio"])
    sims = [r["train"]["updates_per_s"] for r in runs if r["phase"] == SIMS_PHASE]
    if sims:  # training beside the simulators alone, over training alone
        s["updates_per_s_train_sims"] = median(sims)
        s["sims_ratio"] = s["updates_per_s_train_sims"] / s["updates_per_s_train"]
    waits = [r["window_phase_waited_s"] / r["train"]["wall_s"] for r in runs if r["phase"] == "both" and "window_phase_waited_s" in r]
    if waits:  # the share of the both phase training spent waiting for the serving window
        s["window_share_both"] = median(waits)
    busy = [r["act"]["server"]["forward_s_per_s"] for r in runs if r["phase"] == "both" and "server" in r.get("act", {})]
    if busy:  # seconds of forwards per second while both ran
        s["forward_s_per_s_both"] = median(busy)
    s["meets_targets"] = s["update_ratio_judged"] >= UPDATE_TARGET and s["act_p99_ratio"] <= ACT_P99_TARGET
    return s


def _line(r: dict) -> str:
    parts = []
    if "train" in r:
        parts.append(f"updates/s {r['train']['updates_per_s']:.2f} (step p50 {r['train']['step_ms']['p50']:.0f} ms)")
    if "act" in r:
        a = r["act"]
        parts.append(f"act p50 {a['p50_ms']:.1f} p99 {a['p99_ms']:.1f} max {a['max_ms']:.1f} ms, "
                     f"{a['chunks_per_s']:.1f} chunks/s, batch {a['mean_batch']:.2f}")
        if "sim" in a:
            parts.append(f"{a['sim']['env_steps_per_s']:.0f} env steps/s, {a['sim']['sim_s_per_chunk'] * 1000:.0f} ms "
                         "simulated per chunk")
        if "server" in a:
            parts.append(f"forward p50 {a['server']['forward_p50_ms']:.1f} p99 {a['server']['forward_p99_ms']:.1f} ms")
    parts.append(f"probe wait p99 {r['gil_wait_ms']['p99']:.2f} ms")
    if "window" in r:  # cumulative over the stream's phases
        w = r["window"]
        parts.append(f"window so far: {w['windows']} windows, training waited {w['waited_s']:.1f} s at "
                     f"{w['waits']} of {w['checkpoints']} checkpoints")
    return "; ".join(parts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="pi0,openvla_oft")
    ap.add_argument("--tiny", action="store_true", help="tiny test-size models (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--actors", type=int, default=8)
    ap.add_argument("--period", default="0",
                    help="s between one actor's requests (0: closed loop, no simulator; 0.5: a robot's chunk "
                         "rate) or 'sim' (closed-loop simulated actors, each stepping its own --env); "
                         "several, comma-separated, run one after another on the same built policies")
    ap.add_argument("--env", default=None,
                    help="the simulated actors' env (registry name, e.g. libero_spatial); the policies are "
                         "built for its layout (cameras, state, action)")
    ap.add_argument("--env-set", action="append", default=[], metavar="KEY=VALUE",
                    help="env config entries for --env (repeat), e.g. gl=egl task_id=all")
    ap.add_argument("--execute", type=int, default=0,
                    help="actions of each chunk a simulated actor runs before asking again (0: PI0 5, others "
                         "the whole chunk)")
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="priority,shared",
                    help="inference.cuda_stream settings to compare, and 'window' or 'window:LEAD': priority "
                         "plus a serving window (learner/serving_window.py) hooked to the trained copy")
    ap.add_argument("--serving-set", action="append", default=[], metavar="KEY=VALUE",
                    help="policy settings of the serving copy only (repeat; YAML values), e.g. fast_llm_fp8=true")
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--update", default="auto", choices=("auto", *UPDATES),
                    help="bc: a bc_loss step (rejection sampling's update); grpo: a GRPOAgent update round; "
                         "auto: grpo for openvla_oft_discrete (GRPO's OFT), bc for the others")
    ap.add_argument("--grpo-minibatch", type=int, default=8,
                    help="chunks per optimizer step of a GRPO update round (the round covers --train-batch)")
    ap.add_argument("--publish-every", type=int, default=25)
    ap.add_argument("--batch-window-ms", type=float, default=2.0)
    ap.add_argument("--batch-due-ms", type=float, default=0.0,
                    help="inference.batch_due_ms: also linger this long for an actor whose next request is due")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--num-threads", default="auto",
                    help="trainer.num_threads: torch's intra-op threads in this process (auto, the learner's "
                         "default: 1 on a GPU, torch's default on a CPU; 0: torch's default; N)")
    ap.add_argument("--no-sims-phase", action="store_true",
                    help="sim loads: leave out the train_sims phase (training beside the simulators alone)")
    ap.add_argument("--trace", default=None, help="folder for torch.profiler traces of the 'both' phases")
    ap.add_argument("--trace-seconds", type=float, default=3.0)
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout only JSON)")
    args = ap.parse_args(argv)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.streams = [s for s in args.streams.split(",") if s]
    args.periods = parse_loads(args.period)
    args.env_cfg = env_config(args)
    args.serving_cfg = key_values(args.serving_set, "--serving-set")
    if SIM in args.periods and args.env_cfg is None:
        raise SystemExit("--period sim: closed-loop simulated actors need --env (e.g. --env libero_spatial)")
    threads = intra_op_threads(args.num_threads, gpu=args.device.startswith("cuda"))
    if threads:
        torch.set_num_threads(threads)
    elif args.tiny and args.device == "cpu":
        torch.set_num_threads(1)
    if args.env_cfg is not None:
        from envs.registry import env_spec

        spec = env_spec(args.env_cfg)
    else:
        spec = bench_spec(8, 7, ["image", "wrist_image"], args.image_size, has_task=True)
    out = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "tiny": args.tiny, "actors": args.actors, "periods_s": args.periods, "env": args.env_cfg,
           "batch_window_ms": args.batch_window_ms, "batch_due_ms": args.batch_due_ms,
           "num_threads": torch.get_num_threads(),
           "serving_overrides": args.serving_cfg,
           "seconds": args.seconds, "repeats": args.repeats, "train_batch": args.train_batch, "update": args.update,
           "grpo_minibatch": args.grpo_minibatch,
           "publish_every": args.publish_every, "gpu_before": gpu_state(), "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.policies.split(","):
            print(f"== {name} ({'tiny' if args.tiny else 'full size'}, {out['device']}), {args.actors} actors, "
                  f"period(s) {args.periods} s", file=sys.stderr, flush=True)
            out["policies"][name] = r = bench_one(name, args, spec, Path(tmp) / name)
            for period, by in r["by_period"].items():
                for mode, s in by.items():
                    print(f"  {name} period {period} {mode}: updates/s {s['updates_per_s_both']:.2f} of "
                          f"{s['updates_per_s_train']:.2f} alone ({s['update_ratio']:.2f}x; step p50 "
                          f"{s['step_ratio']:.2f}x; target >= 0.8); act p99 "
                          f"{s['act_p99_ms_both']:.1f} of {s['act_p99_ms_serve']:.1f} ms alone "
                          f"({s['act_p99_ratio']:.2f}x, target <= 1.3)", file=sys.stderr, flush=True)
    out["gpu_after"] = gpu_state()
    if args.json:
        emit_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
