#!/usr/bin/env python
"""Transport benchmark entry point (``python -m tools.bench_transport [--json] ...``; also runs as
``python tools/bench_transport.py``). The bench lives in :mod:`tools.bench.transport`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.transport import main, parse_args, run_bench, summary  # noqa: E402

__all__ = ["main", "parse_args", "run_bench", "summary"]

if __name__ == "__main__":
    sys.exit(main())
