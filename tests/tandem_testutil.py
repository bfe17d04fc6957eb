"""Shared test helpers (a uniquely named module: some installed package ships a top-level
``tests`` package, so ``tests.conftest`` cannot be imported by name)."""

import json
import math
import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now that this process has not handed out before, nor within 2 of
    one (a learner binds ``port + 2`` too): the OS gives a just-released port back at once, so
    two calls in a row returned the same one. Under pytest-xdist each worker takes only ports
    from its own blocks of 16 (block number modulo the number of workers; Linux's ``bind`` to
    port 0 gives ports of one parity only, so a split by parity would starve a worker), and
    never the last 3 of a block, so a port + 2 stays in the block: workers never pick the same."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    mine = int(worker[2:]) % n if worker.startswith("gw") and worker[2:].isdigit() else 0
    for _ in range(2000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if (port // 16) % n == mine and port % 16 < 13 and not any(port + d in _HANDED_OUT for d in range(-2, 3)):
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port found in 2,000 tries")


def two_proportion_z(p1: float, p0: float, n: int) -> float:
    """Two-proportion z statistic (pooled) of p1 vs p0, n episodes each."""
    p = (p1 + p0) / 2
    se = math.sqrt(max(2 * p * (1 - p) / n, 1e-12))
    return (p1 - p0) / se


def import_blocker(blocked) -> str:
    """Python source to run first in a subprocess: importing any module in ``blocked`` (or a
    submodule) raises ImportError and is noted in ``tried``; ``blocked_loaded()`` lists the
    blocked modules that got into ``sys.modules`` anyway."""
    return f"""
import importlib.abc, sys
BLOCKED = {tuple(blocked)!r}
tried = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            tried.append(name)
            raise ImportError(f"{{name}} is not installed here (test)")
        return None

sys.meta_path.insert(0, Block())

def blocked_loaded():
    return sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
"""


def run_learning_demo(main, out, *, updates: int, seed: int, max_minutes: float) -> dict:
    """A learning demo's ``main`` (tools.experiments.flow_ppo_demo, tools.experiments.oft_grpo_demo) run to ``updates``
    updates (``max_minutes`` only bounds a stuck run; no success target stops it); prints the
    figures the verdict reads and returns the summary."""
    r = main(["--out", str(out), "--updates", str(updates), "--minutes", str(max_minutes),
              "--seed", str(seed), "--target", "1.01"])
    print(json.dumps({k: r[k] for k in ("episodes", "updates", "wall_s", "before", "windows")}))
    return r


def assert_learning_run_lifts(r: dict, *, updates: int, start_max: float, margin: float,
                              min_window: int, min_start_episodes: int, after_min: float = 0.0) -> None:
    """The learning tests' verdict on a ``tools.experiments.learning_run.run`` summary: ``updates`` were
    done; version 0 (the starting policy, >= ``min_start_episodes`` episodes) succeeded at most
    ``start_max``; the best window of >= ``min_window`` episodes from version 1 on succeeded at
    least ``margin`` more often and at least ``after_min``."""
    assert r["updates"] >= updates, f"stopped early: {r['updates']} updates in {r['wall_s']} s"
    before = r["before"]
    assert before["episodes"] >= min_start_episodes and before["success"] <= start_max, before
    later = [w for w in r["windows"] if w[0] >= 1 and w[2] >= min_window]  # [first v, last v, n, success]
    assert later, r["windows"]
    best = max(later, key=lambda w: w[3])
    assert best[3] >= before["success"] + margin and best[3] >= after_min, (before, r["windows"])


def python_code(code: str, *, timeout: float = 900, triton_interpret: bool = True,
                env: dict[str, str] | None = None) -> str:
    """``code`` run by this interpreter in a fresh process with the repository and tests/ on its
    path (under Triton's interpreter, ``TRITON_INTERPRET=1``, unless told otherwise: it must be
    set before triton is imported) and ``env`` added to its environment; its stdout, after
    asserting that it exited 0."""
    import subprocess
    import sys

    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout
