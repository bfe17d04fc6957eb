"""Replay buffer benchmark entry point (``python -m tools.bench_buffer [--json] ...``; also runs
as ``python tools/bench_buffer.py``). The bench lives in :mod:`tools.bench.buffer`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.buffer import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    main()
