"""Process-level measurement helpers (Linux /proc): CPU time per thread, page pre-faulting,
child processes, resident memory, the machine's busy time,
cProfile text."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import threading
from pathlib import Path
from typing import Any

import numpy as np


def prefault(obj: Any, depth: int = 3) -> int:
    """Fault in the pages of every numpy array reachable from ``obj``'s attributes (dicts,
    lists, nested objects, ``depth`` levels) by rewriting one byte per page with its own value
    (contents unchanged); returns the bytes covered. Generic on purpose: the replay buffer's
    internal layout is not the bench's business."""
    seen: set[int] = set()

    def walk(x: Any, d: int) -> int:
        if id(x) in seen:
            return 0
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            if x.flags.writeable and x.flags.c_contiguous and x.dtype != object and x.nbytes:
                b = x.reshape(-1).view(np.uint8)
                b[::4096] += 0  # a write per page: maps it, keeps the value
                return x.nbytes
            return 0
        if d <= 0:
            return 0
        if isinstance(x, dict):
            return sum(walk(v, d - 1) for v in x.values())
        if isinstance(x, (list, tuple)) and len(x) <= 64:
            return sum(walk(v, d - 1) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, type):
            return sum(walk(v, d - 1) for v in vars(x).values())
        return 0

    return walk(obj, depth)


def task_cpu(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """Thread id -> (kernel name, CPU seconds so far) of every thread of ``pid`` (Linux /proc;
    else {}): /proc/<pid>/task/<tid>/schedstat (nanoseconds), falling back to the
    tick-granular utime+stime of .../stat."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            try:
                with open(f"{base}/schedstat") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
        out[int(tid)] = (comm, cpu)
    return out


def label_cpu(tasks: dict[int, tuple[str, float]], labels: dict[int, str]) -> dict[str, float]:
    """:func:`task_cpu`'s figures summed by label (``labels[tid]``, else the kernel name)."""
    out: dict[str, float] = {}
    for tid, (comm, cpu) in tasks.items():
        label = labels.get(tid, comm)
        out[label] = out.get(label, 0.0) + cpu
    return out


def thread_cpu(labels: dict[int, str] | None = None, pid: int | str = "self") -> dict[str, float]:
    """CPU seconds used so far by each thread of this process, by label (Linux /proc; else {}).

    Python threads are named by their Thread name (or ``labels[native_id]``), others by their
    kernel name (libzmq's I/O threads: ZMQbg/...); threads sharing a label are summed
    (:func:`task_cpu` reads them)."""
    names = {}
    if pid == "self":
        names = {t.native_id: "pyzmq-gc" if type(t).__name__ == "GarbageCollectorThread" else t.name
                 for t in threading.enumerate() if t.native_id is not None}
    names.update(labels or {})
    return label_cpu(task_cpu(pid), names)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def stats_text(prof: cProfile.Profile, top: int, sort: str = "tottime") -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats(sort).print_stats(top)
    return buf.getvalue()


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / tck, sum(v) / tck


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (/proc/<pid>/task/*/children)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` now, MB (0.0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
