"""Run a module (``-m learner ...``, ``-m actor ...``) and, from ``--every`` seconds on, under
tracemalloc; write every ``--every`` seconds the Python allocations that grew since the first
dump (grouped by traceback, top ``--top``), with the traced total and the process RSS, to
``--out``. A heap
that stays flat while RSS grows points at native memory (torch, pyarrow, glibc).

    python -m tools.bench.memtrace --out runs/mem/learner.txt --every 120 -- -m learner env=reacher
    python -m tools.bench.soak --minutes 8 --memtrace ...   # the learner and the first actor
"""

from __future__ import annotations

import argparse
import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _watch(out: Path, every: float, top: int, frames: int) -> None:
    """Tracing starts after ``every`` seconds (imports under tracemalloc take minutes): what
    is allocated from then on and still alive is the growth."""
    base = None
    t0 = time.monotonic()
    time.sleep(every)
    tracemalloc.start(frames)
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, __file__, all_frames=True)])  # this thread's own
        traced = tracemalloc.get_traced_memory()[0] / 2**20
        if base is None:
            base, base_traced, base_rss = snap, traced, _rss_mb()
            continue
        lines = [f"t={time.monotonic() - t0:.0f}s traced {traced:.1f} MB "
                 f"({traced - base_traced:+.1f}) rss {_rss_mb():.1f} MB ({_rss_mb() - base_rss:+.1f})"]
        for s in snap.compare_to(base, "traceback")[:top]:
            lines.append(f"{s.size_diff / 2**10:+9.1f} KiB {s.count_diff:+7d} blocks  "
                         f"(now {s.size / 2**10:.1f} KiB)")
            lines += ["      " + ln.strip() for ln in s.traceback.format(limit=frames, most_recent_first=True)
                      if ln.strip() and not ln.startswith("    ")]
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=float, default=120.0, help="seconds between dumps (the first is the base)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--frames", type=int, default=6, help="traceback depth kept")
    ap.add_argument("-m", dest="module", required=True)
    a, rest = ap.parse_known_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_watch, args=(out, a.every, a.top, a.frames), daemon=True,
                     name="memtrace").start()
    sys.argv = [a.module, *(r for r in rest if r != "--")]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
