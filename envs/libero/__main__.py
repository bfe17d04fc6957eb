"""``python -m envs.libero --check``: are the assets, a render and a forced success working
(:mod:`envs.libero.check`)? ``python -m envs.libero``: LIBERO steps per second for image
sizes and render qualities."""

from __future__ import annotations

import os

import numpy as np

from envs.libero.assets import prepare_libero
from envs.libero.env import LiberoEnv
from envs.libero.rendering import RENDER_QUALITIES
from envs.libero.spec import ACTION_DIM


def _bench(argv: list[str] | None = None) -> None:
    """``python -m envs.libero --gl osmesa --size 128 --quality faithful``: steps/s."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--suite", default="libero_spatial")
    ap.add_argument("--task-id", type=int, default=0)
    ap.add_argument("--gl", default="auto")
    ap.add_argument("--size", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--quality", nargs="+", default=list(RENDER_QUALITIES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-cameras", action="store_true", help="physics only")
    args = ap.parse_args(argv)
    gl = prepare_libero(gl=args.gl) and os.environ.get("MUJOCO_GL")
    rng = np.random.default_rng(0)
    runs = [(0, "physics")] if args.no_cameras else [(s, q) for s in args.size for q in args.quality]
    for size, quality in runs:
        t0 = time.perf_counter()
        env = LiberoEnv(args.suite, args.task_id, image_size=size or 128,
                        cameras={} if args.no_cameras else None,
                        render_quality="faithful" if quality == "physics" else quality)
        env.reset(seed=0)
        t1, c1 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            env.step(rng.uniform(-1, 1, ACTION_DIM).astype(np.float32))
        t2, c2 = time.perf_counter(), time.process_time()
        env.reset()
        t3 = time.perf_counter()
        env.close()
        print(f"{args.suite}/{args.task_id} gl={gl} size={size} quality={quality}: "
              f"{args.steps / (t2 - t1):.2f} steps/s (wall; {args.steps / (c2 - c1):.2f} per CPU-second "
              f"of this process), build+reset {t1 - t0:.1f} s, reset {t3 - t2:.2f} s",
              flush=True)


def _check(argv: list[str]) -> int:
    import argparse

    from envs.libero.check import run_checks

    ap = argparse.ArgumentParser(prog="python -m envs.libero --check",
                                 description="check LIBERO's assets, a render and a forced success")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--suite", default="libero_spatial")
    ap.add_argument("--task-id", type=int, default=0)
    ap.add_argument("--gl", default="auto")
    ap.add_argument("--assets-path", help="a LIBERO assets folder")
    ap.add_argument("--assets-tarball", help="a .tar.* of a LIBERO assets folder")
    args = ap.parse_args(argv)
    return run_checks(args.suite, args.task_id, assets_path=args.assets_path,
                      assets_tarball=args.assets_tarball, gl=args.gl)


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv[1:]:
        sys.exit(_check(sys.argv[1:]))
    _bench()
