#!/usr/bin/env python
"""VLA serving benchmark entry point (``python -m tools.bench_policy [--json PATH] ...``; its actor
processes run ``python -m tools.bench_policy --client ...``). The bench lives in
:mod:`tools.bench.policy`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.policy import bench_policy, main, report  # noqa: E402

__all__ = ["bench_policy", "main", "report"]

if __name__ == "__main__":
    main()
