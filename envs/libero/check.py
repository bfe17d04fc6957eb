"""``python -m envs.libero --check``: is LIBERO ready on this machine?

Three checks, one line each (``ok`` or ``FAIL``, and for a failure the fix):

1. **assets**: the LIBERO assets folder is found (:func:`envs.libero.assets.resolve_assets`:
   ``--assets-path`` / ``--assets-tarball``, ``$TANDEM_LIBERO_ASSETS`` /
   ``$TANDEM_LIBERO_ASSETS_TARBALL``, LIBERO's own folders, ``../shared/libero-assets.tar.xz``);
   a tarball is extracted once into the cache;
2. **render**: one task is built, reset and stepped headless, and both cameras show a scene;
3. **success**: the task's goal is forced (:func:`envs.libero.goals.force_goal_state`) and
   the next step pays 1.0 and terminates.

Exits 0 when all pass, 1 otherwise (a check after a failed one is reported as skipped).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from envs.libero.assets import DEV_TARBALL, cache_root, prepare_libero

ASSETS_FIX = (
    "fix: export TANDEM_LIBERO_ASSETS_TARBALL=/path/to/libero-assets.tar.xz (on the project's "
    "machines /work/shared/libero-assets-spatial.tar.xz, or ../shared/libero-assets.tar.xz next "
    "to the checkout, found by itself), or TANDEM_LIBERO_ASSETS=/path/to/LIBERO/assets (the "
    "folder with scenes/, articulated_objects/, ...); nothing is ever downloaded"
)
RENDER_FIX = (
    "fix: install a headless OpenGL (Debian: libosmesa6, or libegl1 + libgl1-mesa-dri) or pick "
    "one with MUJOCO_GL=osmesa|egl"
)


def _assets_source(assets: Path, assets_path: str | None, assets_tarball: str | None) -> str:
    if assets_path or assets_tarball:
        return f"--assets-path {assets_path}" if assets_path else f"--assets-tarball {assets_tarball}"
    for var in ("TANDEM_LIBERO_ASSETS", "TANDEM_LIBERO_ASSETS_TARBALL"):
        if os.environ.get(var):
            return f"${var}={os.environ[var]}"
    if assets.is_relative_to(cache_root()):
        return f"{DEV_TARBALL}, extracted once into the cache"
    return "LIBERO's own assets folder"


def run_checks(suite: str = "libero_spatial", task_id: int = 0, *, assets_path: str | None = None,
               assets_tarball: str | None = None, gl: str | None = "auto", image_size: int = 64,
               out: Callable[[str], None] = print) -> int:
    """Run the three checks, printing one line per check; return the exit status (0 ok)."""
    t0 = time.perf_counter()
    try:
        assets = prepare_libero(assets_path, assets_tarball, gl=gl)
    except ImportError as exc:
        out(f"FAIL assets: LIBERO is not installed ({exc})")
        out("     fix: uv sync --frozen (LIBERO and robosuite are locked dependencies)")
        out("skip render, success: they need LIBERO")
        return 1
    except (FileNotFoundError, ValueError) as exc:
        out(f"FAIL assets: {exc}")
        out(f"     {ASSETS_FIX}")
        out("skip render, success: they need the assets")
        return 1
    out(f"ok   assets: {assets} (from {_assets_source(assets, assets_path, assets_tarball)}), "
        f"{time.perf_counter() - t0:.1f} s")

    from envs.libero.env import LiberoEnv
    from envs.libero.goals import force_goal_state

    env = None
    try:
        t0 = time.perf_counter()
        try:
            env = LiberoEnv(suite, task_id, image_size=image_size, num_steps_wait=0)
            obs, _ = env.reset(seed=0)
            obs, *_ = env.step(np.zeros(7, np.float32))
            imgs = {k: v for k, v in obs.items() if k.startswith("observation.images.")}
            flat = [k for k, v in imgs.items() if v.std() <= 5]
            if not imgs or flat:
                raise RuntimeError(f"cameras {flat or 'none'} rendered a blank image")
        except Exception as exc:  # any failure here is the render check's
            out(f"FAIL render: {suite} task {task_id} with MUJOCO_GL={os.environ.get('MUJOCO_GL')}: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            out(f"     {RENDER_FIX}")
            out("skip success: it needs a working env")
            return 1
        out(f"ok   render: {suite} task {task_id} ({env.task.language!r}), MUJOCO_GL="
            f"{os.environ.get('MUJOCO_GL')}, {len(imgs)} cameras {image_size}x{image_size}, "
            f"{time.perf_counter() - t0:.1f} s")
        forced = force_goal_state(env)
        _, reward, terminated, _, info = env.step(np.array([0, 0, 0, 0, 0, 0, -1], np.float32))
        if not (forced and reward == 1.0 and terminated and info.get("is_success")):
            out(f"FAIL success: forcing the goal gave check_success={forced}, then reward {reward}, "
                f"terminated {terminated}")
            out("     fix: the LIBERO install or its assets do not match this task's goal; "
                "reinstall the locked dependencies (uv sync --frozen) and use the project's tarball")
            return 1
        out("ok   success: forced goal state -> reward 1.0, terminated, info['is_success']")
        return 0
    finally:
        if env is not None:
            env.close()
