"""LIBERO benchmark suites as gymnasium envs, headless and offline.

Observation (a ``gym.spaces.Dict`` in the common schema of :mod:`data.core.schema`)::

    "observation.state"              float32 [8]  eef pos (3) + eef axis-angle (3) + gripper qpos (2)
    "observation.images.image"       uint8 [H, W, 3]  agent view, rotated 180 degrees
    "observation.images.wrist_image" uint8 [H, W, 3]  eye-in-hand, rotated 180 degrees
    "task"                           str   the task's language instruction

as in the published OpenVLA-OFT LIBERO evaluation (``get_libero_image`` flips both image
axes; the state concatenates ``robot0_eef_pos``, ``quat2axisangle(robot0_eef_quat)`` and
``robot0_gripper_qpos``). Camera names are configurable (``cameras``: LIBERO camera ->
key suffix), e.g. ``{agentview: image, robot0_eye_in_hand: image2}`` for LeRobot's naming.

Action: float32 Box [-1, 1]^7, LIBERO's OSC_POSE delta (dx, dy, dz, droll, dpitch, dyaw,
gripper; gripper -1 opens, +1 closes). Reward 1.0 on the step that reaches the task's goal
(which terminates the episode), else 0.0; ``info["is_success"]``. The per-suite time limit
(OpenVLA-OFT: spatial 220, object 280, goal 300, libero_10 520, libero_90 400 policy steps)
is exposed as ``default_max_episode_steps`` and applied by :func:`envs.registry.make_env`.

Tasks and initial states. The config's ``task_id`` is one task index (LIBERO's default
order), a list of them or ``"all"`` (a multi-task env: episode ``k`` uses task ``k mod T``,
and switching task rebuilds the scene, ~2-5 s). Reset restores one of the task's fixed
initial states (config ``init_state_id``; with ``null``, episode ``k`` -- the reset's seed if
given, else a counter -- takes state ``(k div T) mod N``), then runs ``num_steps_wait``
no-op steps (default 10, as OpenVLA-OFT does, so objects settle); these do not count toward
the time limit.

Learner-driven episodes (:class:`data.core.jobs.Job`): ``reset(seed=s, options={"task_id":
t, "init_state": i})`` runs suite task ``t`` from its init state ``i`` exactly. ``t`` is an
index into the suite's task list and must be one of the tasks the env was configured with
(``task_id: all`` allows every task of the suite); ``i`` must be in ``0..N-1`` for that
task (N is 50 for the published suites). Anything else, or an unknown option key, is a
``ValueError`` naming the valid range, raised before the env changes. ``info["task_id"]``
and ``info["init_state"]`` report what the reset used (on every reset, job or not); the seed
still picks the fixture layout (below).

Offline set-up (:func:`prepare_libero`, :mod:`envs.libero.assets`) happens before ``libero``
is first imported: ``LIBERO_CONFIG_PATH`` points at a config dir the project writes (so the
import never calls ``input()``); the assets come from the config's ``assets_path`` /
``assets_tarball`` or the fallbacks listed in :mod:`envs.libero.assets`, never from the
network; the GL backend is chosen by :func:`envs.rendering.configure_rendering` (config key
``gl``). Initial states are read with a restricted unpickler (numpy arrays only), so neither
torch nor ``libero.libero.benchmark`` (which imports torch) is loaded.

Differences from OpenVLA-OFT's loop, on purpose: resets are *soft* by default
(``hard_reset: false``: the scene is not recompiled, 0.3-1.5 s instead of 4-5 s; the
restored state differs from a hard reset's by ~2e-4 in the end-effector pose after the
settle steps); the settle steps are not rendered (``fast_settle``); LIBERO re-samples fixture
placements on every reset (they are not part of the init states) from numpy's global RNG,
which this env seeds from its own RNG, so ``reset(seed=s)`` reproduces a layout.

Modules: :mod:`~envs.libero.tasks` (suites, task lists, limits, init states),
:mod:`~envs.libero.assets` (offline assets and config), :mod:`~envs.libero.rendering`
(GL buffer size and render quality), :mod:`~envs.libero.env` (the env and its factory),
:mod:`~envs.libero.spec` (the layout from a config, no simulator), :mod:`~envs.libero.goals`
(forcing a goal state for tests), :mod:`~envs.libero.check` (``python -m envs.libero
--check``: assets, a render, a forced success). ``python -m envs.libero`` measures steps/s.

The names below are loaded on first use, so ``import envs.libero.spec`` (the learner reading
a spec) loads neither the env module nor gymnasium.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LiberoEnv": "env", "make_libero_env": "env", "quat2axisangle": "env",
    "force_goal_state": "goals",
    "libero_spec": "spec", "DEFAULT_CAMERAS": "spec", "STATE_DIM": "spec", "ACTION_DIM": "spec",
    "LiberoTask": "tasks", "SUITES": "tasks", "SUITE_MAX_STEPS": "tasks", "list_tasks": "tasks",
    "load_init_states": "tasks",
    "ASSET_SUBDIRS": "assets", "cache_root": "assets", "extract_assets_tarball": "assets",
    "prepare_libero": "assets", "resolve_assets": "assets",
    "RENDER_QUALITIES": "rendering",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from envs.libero.assets import (ASSET_SUBDIRS, cache_root, extract_assets_tarball,
                                    prepare_libero, resolve_assets)
    from envs.libero.env import LiberoEnv, make_libero_env, quat2axisangle
    from envs.libero.goals import force_goal_state
    from envs.libero.rendering import RENDER_QUALITIES
    from envs.libero.spec import ACTION_DIM, DEFAULT_CAMERAS, STATE_DIM, libero_spec
    from envs.libero.tasks import (SUITE_MAX_STEPS, SUITES, LiberoTask, list_tasks,
                                   load_init_states)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'envs.libero' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"envs.libero.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
