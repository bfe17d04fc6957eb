"""The fleet bench's readings of the learner while N robots run (:mod:`tools.bench.fleet`):
its status.json, the CPU of its threads (named from that file) and child processes, of the
robots' processes and of the machine, peak resident memory, and the GPU's utilization and
memory (:mod:`tools.bench.fleet_gpu`) where the learner has one."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from tools.bench.fleet_gpu import gpu_sample
from tools.bench.procstat import children, cpu_delta, label_cpu, machine_busy, rss_mb, task_cpu, thread_cpu


def child_label(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "gate_main" in cmd:
        return "wire-gate"
    if "multiprocessing" in cmd or "spawn_main" in cmd:
        return "resource-tracker" if "resource_tracker" in cmd else "encoder-workers"
    return Path(cmd.split()[0]).name if cmd else "child"


def read_status(run_dir: Path) -> dict:
    try:
        st = json.loads((run_dir / "status.json").read_text())
        st["_mtime"] = (run_dir / "status.json").stat().st_mtime
        return st
    except (OSError, ValueError):
        return {}


class Sampler:
    """CPU seconds of the learner's threads (named from its status.json), of its child
    processes by label, of the robots' processes and of the machine; peak RSS every second,
    and with ``gpu`` (the learner's CUDA device) the GPU's utilization and memory."""

    def __init__(self, learner_pid: int, worker_pids: list[int], run_dir: Path, gpu: str | None = None):
        self.pid, self.workers, self.run_dir = learner_pid, worker_pids, run_dir
        self.peak = {"learner": 0.0, "children": 0.0, "robots": 0.0}
        self.gpu, self.gpu_samples = gpu, []  # (monotonic t, util %, MiB used)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()

    def snapshot(self) -> dict:
        st = read_status(self.run_dir)
        kids: dict[str, float] = {}
        for c in children(self.pid):
            lab = child_label(c)
            for k in [c, *children(c)]:
                kids[lab] = kids.get(lab, 0.0) + sum(thread_cpu(pid=k).values())
        each = {w: sum(thread_cpu(pid=w).values()) for w in self.workers}
        busy, total = machine_busy()
        return {"t": time.monotonic(), "tasks": task_cpu(self.pid), "children": kids, "robots": sum(each.values()),
                "robots_each": each, "busy": busy, "total": total, "status": st}

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            kids = sum(rss_mb(c) for c in children(self.pid))
            cur = {"learner": rss_mb(self.pid), "children": kids,
                   "robots": sum(rss_mb(w) for w in self.workers)}
            self.peak = {k: max(v, cur[k]) for k, v in self.peak.items()}
            g = gpu_sample(self.gpu) if self.gpu else None
            if g is None and self.gpu:  # no nvidia-smi: the learner's own reading (status.json)
                st = read_status(self.run_dir).get("gpu") or {}
                g = (st["util_pct"], st["mem_gib"] * 1024) if "util_pct" in st else None
            if g is not None:
                self.gpu_samples.append((time.monotonic(), *g))

    def close(self) -> None:
        self._stop.set()


def window(a: dict, b: dict, names: dict) -> dict:
    """CPU (cores) of the window between two snapshots; ``names``: thread id -> Python thread
    name (the learner's status.json; threads it does not name keep their kernel name)."""
    dt = b["t"] - a["t"]
    labels = {int(k): v for k, v in names.items()}
    th = cpu_delta(label_cpu(a["tasks"], labels), label_cpu(b["tasks"], labels))
    kids = cpu_delta(a["children"], b["children"])
    ncpu = os.cpu_count() or 1
    return {"seconds": dt,
            "learner_threads": {k: round(v / dt, 3) for k, v in sorted(th.items(), key=lambda kv: -kv[1])},
            "learner_children": {k: round(v / dt, 3) for k, v in kids.items()},
            "robots": round((b["robots"] - a["robots"]) / dt, 3),
            # the busiest robot process: at ~1 core its interpreter, not the learner, paces its robots
            "robots_max_process": round(max([(b["robots_each"].get(w, 0.0) - v) / dt
                                             for w, v in a["robots_each"].items()] or [0.0]), 3),
            "machine_busy_cores": round((b["busy"] - a["busy"]) / max(1e-9, b["total"] - a["total"]) * ncpu, 3)}
