"""Soak: a learner and N actors (real processes, loopback) for a given time, sampled every few
seconds; does anything grow that should stay flat?

Per sample: RSS (MiB), open fds and threads of the learner and of the actors (summed), the
act round-trip p99 (ms) of a probe client that asks the learner for actions like a remote
actor does (requests since the previous sample), the ingest lag (records the actors have
spooled that the learner has not received yet, summed over actors; from the actors'
``spool/*/meta.json`` and the learner's ``status.json``) and the store backlog (finished
episodes the learner holds in memory, waiting for the dataset writer: ``dataset_pending``).
A writer slower than the actors grows that backlog, the learner's RSS with it, and the
actors' (unacknowledged records stay in their spools' memory cache).

The learner's replay ring is ``buffer.capacity=5000`` unless an override says otherwise:
its arrays are allocated up front but their pages are touched as it fills, so a ring still
filling is RSS growth that stops when it is full; this one fills during the warm-up.
``--memtrace S`` runs the learner and the first actor under :mod:`tools.bench.memtrace`.

Writes ``soak.csv``, ``soak.json`` (samples + verdicts) and ``soak.png`` into ``--out``, and
prints for each line whether it stayed flat: a least-squares slope over the samples after
the warm-up, projected over the measured span, within ``--tolerance`` of the line's mean
(or within its absolute floor, for lines that sit near zero). Only growth fails the soak; a
line that fell by more than that is reported as ``falling``.

    .venv/bin/python -m tools.bench.soak --minutes 30 --actors 2 --out runs/soak
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parents[2]
#: absolute floors under which a line counts as flat whatever its relative change
FLOORS = {"learner_rss_mb": 32.0, "actors_rss_mb": 32.0, "learner_fds": 4, "actors_fds": 4,
          "learner_threads": 2, "actors_threads": 2, "act_p99_ms": 5.0, "ingest_lag": 256,
          "store_pending": 64}
LINES = list(FLOORS)
#: default buffer.capacity: 2 reacher actors store ~100 records/s, so it is full within the
#: warm-up and its pages (touched as it fills; 200k records = ~19 MB for reacher) stop
#: counting as growth. Pass buffer.capacity=... to measure another size.
RING = 5000


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """The learner and actors as subprocesses of this tool, logs under ``out``."""

    def __init__(self, out: Path, actors: int, env: str, extra: list[str], memtrace: float = 0.0):
        self.out, self.run_dir = out, out / "run"
        self.port, self.pub = free_port(), free_port()
        common = [f"env={env}", f"run_dir={self.run_dir}", f"transport.port={self.port}",
                  f"transport.pub_port={self.pub}"]
        penv = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        # the replay ring's pages are touched as it fills: sized to fill during the warm-up
        ring = [] if any(x.startswith("buffer.capacity=") for x in extra) else [f"buffer.capacity={RING}"]
        self.memtrace = memtrace
        self.procs["learner"] = self._start("learner", [
            *self._module("learner"), *common, *ring, "logging.wandb=disabled", "logging.every_s=1",
            "trainer.num_threads=1", "buffer.video=false", *extra], penv)
        self.actor_ids = [f"soak{i}" for i in range(actors)]
        for i, a in enumerate(self.actor_ids):
            self.procs[a] = self._start(a, [*self._module("actor", traced=i == 0), *common, f"actor_id={a}", f"seed={i}",
                                            "spool.fsync=false", "log_every_s=5"], penv)

    def _module(self, module: str, traced: bool = True) -> list[str]:
        """``-m module``, under :mod:`tools.bench.memtrace` with ``--memtrace``."""
        if not (self.memtrace and traced):
            return ["-m", module]
        return ["-m", "tools.bench.memtrace", "--out", str(self.out / f"memtrace_{module}.txt"),
                "--every", str(self.memtrace), "-m", module]

    def _start(self, name, args, env):
        self.out.mkdir(parents=True, exist_ok=True)
        log = open(self.out / f"{name}.log", "ab")
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    def config_hash(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"config hash (\w+)", (self.out / "learner.log").read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.procs["learner"].poll() is not None:
                raise RuntimeError("the learner exited:\n" + (self.out / "learner.log").read_text()[-3000:])
            time.sleep(0.5)
        raise TimeoutError("the learner did not start")

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def produced(self) -> dict[str, int]:
        out = {}
        for a in self.actor_ids:
            try:
                out[a] = int(json.loads((self.run_dir / "spool" / a / "meta.json").read_text())["next_seq"])
            except (OSError, ValueError, KeyError):
                out[a] = 0
        return out

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> None:
        """Actors first (they drain their spools into the live learner), then the learner.
        SIGTERM, which both handle as Ctrl-C: a tool started in the background (``cmd &``)
        passes an ignored SIGINT on to its children."""
        order = [self.procs[a] for a in self.actor_ids], [self.procs["learner"]]
        for group in order:
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


class Probe:
    """A remote-mode client in this process: act round trips, one every ``period_s``."""

    def __init__(self, fleet: Fleet, period_s: float = 0.05):
        from actor.client import LearnerClient
        from actor.spool import Spool

        self.ctx = zmq.Context()
        self.client = LearnerClient(ctx=self.ctx, host="127.0.0.1", port=fleet.port, actor_id="soak-probe",
                                    config_hash=fleet.config_hash(),
                                    spool=Spool(fleet.out / "probe-spool", fsync=False))
        self.client.connect(give_up_after_s=300)
        spec = self.client.spec
        self.obs = {"observation.state": np.zeros((1, spec.state_dim), np.float32)}
        for cam, shape in spec.cameras.items():
            self.obs["observation.images." + cam] = np.zeros((1, *shape), np.uint8)
        self.tasks = ["" if not spec.has_task else "soak"]
        self.period_s = period_s
        self.latencies: list[float] = []
        self._next = 0.0

    def tick(self) -> None:
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.period_s
            t0 = time.perf_counter()
            self.client.act(self.obs, self.tasks)
            self.latencies.append((time.perf_counter() - t0) * 1000.0)
        else:
            self.client.poll(0.0)

    def p99(self) -> float:
        lat, self.latencies = self.latencies, []
        return float(np.percentile(lat, 99)) if lat else float("nan")

    def close(self) -> None:
        self.client.close()
        self.ctx.destroy(0)


def proc_stats(procs: list[subprocess.Popen]) -> tuple[float, int, int]:
    rss = fds = threads = 0
    for p in procs:
        try:
            ps = psutil.Process(p.pid)
            for q in [ps, *ps.children(recursive=True)]:
                rss += q.memory_info().rss
                fds += q.num_fds()
                threads += q.num_threads()
        except psutil.Error:
            pass
    return rss / 2**20, fds, threads


def verdicts(rows: list[dict], warmup_s: float, tolerance: float) -> dict[str, dict]:
    """Per line: slope (per minute), projected change over the span, flat or not."""
    out = {}
    t = np.array([r["t_s"] for r in rows])
    for name in LINES:
        y = np.array([r[name] for r in rows], float)
        m = (t >= warmup_s) & np.isfinite(y)
        if m.sum() < 3:
            out[name] = {"flat": None, "why": "too few samples after the warm-up"}
            continue
        slope, _ = np.polyfit(t[m], y[m], 1)
        span = float(t[m].max() - t[m].min())
        change = float(slope * span)
        mean = float(y[m].mean())
        allowed = max(tolerance * abs(mean), FLOORS[name])
        out[name] = {"mean": mean, "first": float(y[m][0]), "last": float(y[m][-1]),
                     "max": float(y[m].max()), "slope_per_min": float(slope * 60),
                     "change_over_span": change, "allowed": allowed, "flat": change <= allowed,
                     "falling": change < -allowed}
    return out


def plot(rows: list[dict], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots((len(LINES) + 1) // 2, 2, figsize=(11, 12), sharex=True)
    t = np.array([r["t_s"] for r in rows]) / 60
    for ax, name in zip(axes.flat, LINES):
        ax.plot(t, [r[name] for r in rows], marker=".", lw=1)
        ax.axvline(warmup_s / 60, color="grey", ls=":", lw=1)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(LINES):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle("tools/bench/soak.py: learner + actors on loopback (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--env", default="reacher")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the verdicts")
    ap.add_argument("--tolerance", type=float, default=0.10,
                    help="allowed change over the run, as a fraction of the line's mean")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--memtrace", type=float, default=0.0, metavar="S",
                    help="run the learner and the first actor under tools.bench.memtrace, a dump every S "
                         "seconds (memtrace_*.txt in --out; slows them)")
    ap.add_argument("overrides", nargs="*", help="extra learner overrides (Hydra)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    fleet = Fleet(out, a.actors, a.env, a.overrides, a.memtrace)
    rows: list[dict] = []
    try:
        probe = Probe(fleet)
        start = time.monotonic()
        next_sample = start + a.every
        print(f"soak: learner + {a.actors} actors for {a.minutes:g} min, a sample every {a.every:g}s; "
              f"out {out}", flush=True)
        while time.monotonic() - start < a.minutes * 60:
            probe.tick()
            time.sleep(0.002)
            if time.monotonic() < next_sample:
                continue
            next_sample += a.every
            dead = fleet.dead()
            if dead:
                raise RuntimeError(f"{dead} exited during the soak; see their logs in {out}")
            st, prod = fleet.status(), fleet.produced()
            recv = st.get("received", {})
            lrss, lfds, lthr = proc_stats([fleet.procs["learner"]])
            arss, afds, athr = proc_stats([fleet.procs[x] for x in fleet.actor_ids])
            row = {"t_s": round(time.monotonic() - start, 1), "learner_rss_mb": lrss, "learner_fds": lfds,
                   "learner_threads": lthr, "actors_rss_mb": arss, "actors_fds": afds,
                   "actors_threads": athr, "act_p99_ms": probe.p99(),
                   "ingest_lag": sum(max(0, n - 1 - int(recv.get(k, -1))) for k, n in prod.items()),
                   "store_pending": st.get("dataset_pending", 0),
                   "updates": st.get("updates", 0), "env_steps": st.get("env_steps", 0),
                   "stored": st.get("stored", 0), "load1": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
        probe.close()
    finally:
        fleet.stop()
    if not rows:
        return 1
    with open(out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    v = verdicts(rows, min(a.warmup, rows[-1]["t_s"] / 3), a.tolerance)
    (out / "soak.json").write_text(json.dumps({"args": vars(a), "verdicts": v, "samples": rows}, indent=1))
    plot(rows, out / "soak.png", min(a.warmup, rows[-1]["t_s"] / 3))
    print(f"\n{'line':<16}{'mean':>10}{'first':>10}{'last':>10}{'/min':>10}  verdict")
    for name, r in v.items():
        if r["flat"] is None:
            print(f"{name:<16}  {r['why']}")
            continue
        print(f"{name:<16}{r['mean']:>10.1f}{r['first']:>10.1f}{r['last']:>10.1f}"
              f"{r['slope_per_min']:>10.2f}  {'GROWING' if not r['flat'] else 'falling' if r['falling'] else 'flat'}")
    print(f"\n{out / 'soak.csv'}, {out / 'soak.json'}, {out / 'soak.png'}")
    return 0 if all(r["flat"] is not False for r in v.values()) else 3


if __name__ == "__main__":
    sys.exit(main())
