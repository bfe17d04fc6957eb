"""The LIBERO gymnasium env (:class:`LiberoEnv`) and its registry factory.

See :mod:`envs.libero` for the observation/action layout, resets and the offline set-up.
The simulator (``libero`` / robosuite / mujoco) is imported and built on the first reset,
never at import or construction, so the spaces can be read without it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.libero import rendering as R
from envs.libero.assets import ensure_libero_config, prepare_libero
from envs.libero.spec import (
    ACTION_DIM,
    DEFAULT_CAMERAS,
    STATE_DIM,
    cameras_of,
    image_hw,
    render_hw,
    suite_of,
)
from envs.libero.tasks import SUITE_MAX_STEPS, list_tasks, load_init_states, parse_task_ids
from envs.reset_options import check_reset_options
from envs.spec import camera_strip, checked_action
from envs.wrappers import TEXT_SPACE

DUMMY_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
#: ``init_state_id`` for a fresh placement from LIBERO's own sampler (none of the fixed states)
RANDOM = "random"


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis-angle (robosuite / OpenVLA-OFT convention)."""
    q = np.asarray(quat, dtype=np.float64).copy()
    q[3] = np.clip(q[3], -1.0, 1.0)
    den = np.sqrt(1.0 - q[3] * q[3])
    if np.isclose(den, 0.0):
        return np.zeros(3)
    return (q[:3] * 2.0 * np.arccos(q[3])) / den


class LiberoEnv(gym.Env):
    """One LIBERO task, or several (multi-task), as a gymnasium env (see :mod:`envs.libero`)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    ee_pos_index = (0, 1, 2)        # end-effector position in observation.state (for SafetyWrapper)
    action_pos_index = (0, 1, 2)    # translation components of the action

    def __init__(
        self,
        suite: str = "libero_spatial",
        task_id: int | Sequence[int] | str = 0,
        *,
        init_state_id: int | str | None = 0,
        image_size: int | tuple[int, int] = 128,
        cameras: dict[str, str] | None = None,
        num_steps_wait: int = 10,
        fast_settle: bool = True,
        hard_reset: bool = False,
        render_quality: str = "faithful",
        assets_path: str | None = None,
        assets_tarball: str | None = None,
        gl: str | None = "auto",
        render_mode: str | None = "rgb_array",
    ):
        tasks = list_tasks(suite)
        ids = parse_task_ids(task_id, len(tasks), suite)
        self.suite = suite
        self.n_suite_tasks = len(tasks)
        self.tasks = [tasks[t] for t in ids]
        self.task_ids = ids
        self._init_states = {t.task_id: load_init_states(t.init_states_file) for t in self.tasks}
        self.task = self.tasks[0]
        self.init_states = self._init_states[self.task.task_id]
        if init_state_id not in (None, RANDOM) and (isinstance(init_state_id, str) or not all(
                0 <= int(init_state_id) < len(v) for v in self._init_states.values())):
            raise ValueError(f"init_state_id {init_state_id!r} must be an index into {suite}'s initial states "
                             f"of tasks {ids}, null (cycle through them) or {RANDOM!r} (new placements)")
        self.init_state_id = init_state_id if init_state_id in (None, RANDOM) else int(init_state_id)
        self._next_cycle = 0
        self._built_task: int | None = None
        self.image_hw = image_hw(image_size)
        self.cameras = dict(DEFAULT_CAMERAS if cameras is None else cameras)
        self.num_steps_wait = int(num_steps_wait)
        self.fast_settle = bool(fast_settle)
        self.hard_reset = bool(hard_reset)
        self.render_quality = R.check_quality(render_quality)
        self.default_max_episode_steps = SUITE_MAX_STEPS[suite]
        self._assets_args = (assets_path, assets_tarball, gl)
        self.render_mode = render_mode
        self._env = None
        self._last_obs: dict[str, Any] | None = None
        self._done = True
        self.current_init_state: int | None = None
        self._expert = None

        obs_spaces: dict[str, spaces.Space] = {
            OBS_STATE: spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32),
        }
        for key in self.cameras.values():
            obs_spaces[OBS_IMAGE_PREFIX + key] = spaces.Box(0, 255, (*self.image_hw, 3), np.uint8)
        obs_spaces[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self.spec = gym.envs.registration.EnvSpec(
            id=f"tandem/{suite}-task{'-'.join(map(str, ids)) if len(ids) < 4 else 'multi'}-v0",
            entry_point="envs.libero:LiberoEnv",
            max_episode_steps=None,
        )

    @property
    def instruction(self) -> str:
        return self.task.language

    # The simulator is built on first reset (not in __init__) so that an env can be
    # constructed in a parent and used in a forked worker with its own GL context.
    def _ensure_env(self):
        if self._env is not None and self._built_task != self.task.task_id:
            self._env.close()  # a multi-task env moved to another task: new scene
            self._env = None
        if self._env is None:
            prepare_libero(*self._assets_args)
            from libero.libero.envs import OffScreenRenderEnv

            h, w = self.image_hw
            cams = list(self.cameras)
            with R.render_settings(self._render_settings()):
                self._env = OffScreenRenderEnv(
                    bddl_file_name=str(self.task.bddl_file),
                    camera_names=cams or ["agentview"],
                    camera_heights=h, camera_widths=w,
                    use_camera_obs=bool(cams),
                    hard_reset=self.hard_reset,
                )
            self._built_task = self.task.task_id
        return self._env

    def _render_settings(self) -> dict[str, int] | None:
        return R.settings_for(self.image_hw, self.render_quality, bool(self.cameras))

    @property
    def sim(self):
        return self._ensure_env().sim

    def _set_cameras_enabled(self, on: bool) -> None:
        inner = self._env.env
        for cam in self.cameras:
            name = f"{cam}_image"
            if name in inner._observables:
                inner.modify_observable(name, "enabled", on)

    def _format(self, raw: dict) -> dict[str, Any]:
        state = np.concatenate([
            raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"],
        ]).astype(np.float32)
        obs: dict[str, Any] = {OBS_STATE: state}
        for cam, key in self.cameras.items():
            # robosuite renders bottom-up; OpenVLA-OFT's get_libero_image rotates 180 degrees.
            obs[OBS_IMAGE_PREFIX + key] = np.ascontiguousarray(raw[f"{cam}_image"][::-1, ::-1])
        obs[TASK] = self.task.language
        return obs

    def _pick(self, seed: int | None, options: Mapping[str, Any] | None):
        """(task, init-state index or None for a sampled placement) for this reset; raises
        before anything changes."""
        opts = check_reset_options(options, f"LIBERO {self.suite}")
        want_task, want_init = opts["task_id"], opts["init_state"]
        n_tasks = len(self.tasks)
        # episode counter k: the seed if given, else the next in turn; with several tasks,
        # task k mod T and init state (k div T) mod N
        k = int(seed) if seed is not None else self._next_cycle
        if want_task is None:
            task = self.tasks[k % n_tasks]
        elif want_task >= self.n_suite_tasks:
            raise ValueError(f"task_id {want_task} is out of range: {self.suite} has tasks "
                             f"0..{self.n_suite_tasks - 1}")
        elif want_task not in self.task_ids:
            raise ValueError(f"task_id {want_task} is not one of this env's tasks {self.task_ids}; "
                             f"configure task_id: all (or a list holding it) to run it")
        else:
            task = self.tasks[self.task_ids.index(want_task)]
        n_init = len(self._init_states[task.task_id])
        if want_init is not None:
            if want_init >= n_init:
                raise ValueError(f"init_state {want_init} is out of range: {self.suite} task "
                                 f"{task.task_id} has init states 0..{n_init - 1}")
            idx = want_init
        elif self.init_state_id == RANDOM:
            idx = None
        elif self.init_state_id is not None:
            idx = self.init_state_id
        else:
            idx = (k // n_tasks) % n_init
        if seed is None:
            self._next_cycle += 1
        return task, idx

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """``options``: ``task_id`` (a suite task index, one of the configured tasks) and
        ``init_state`` (an index into that task's fixed initial states), as a learner's
        :class:`data.core.jobs.Job` gives them; either may be left out (then the config's
        ``init_state_id``, else the episode counter, decides). With ``init_state_id: random``
        and no ``init_state`` option, the objects are where LIBERO's placement sampler puts
        them (seeded by ``seed``): a start outside the fixed initial states, for demos and
        training kept apart from the evaluation states. ``info`` reports both (``init_state``
        None for a sampled placement)."""
        task, idx = self._pick(seed, options)
        super().reset(seed=seed)
        self.task = task
        self.init_states = self._init_states[task.task_id]
        env = self._ensure_env()
        # LIBERO re-samples fixture placements (model body_pos, not part of the init state)
        # from numpy's global RNG on every reset; seed it from this env's RNG so a seeded
        # env reproduces its layouts, and leave the global RNG as it was.
        layout_seed = int(self.np_random.integers(2**31 - 1))
        saved = np.random.get_state()
        np.random.seed(layout_seed)
        # a sampled placement needs LIBERO's hard reset: a soft one places objects that sit on
        # fixtures (the stove, the cabinet's drawer) from the fixtures' old poses
        hard = env.env.hard_reset
        env.env.hard_reset = hard or idx is None
        try:
            with R.render_settings(self._render_settings()):  # a hard reset rebuilds the context
                raw = env.reset()   # objects placed by LIBERO's own sampler (the seeded global RNG)
        finally:
            env.env.hard_reset = hard
            np.random.set_state(saved)
        R.tune_renderer(env.sim, self.render_quality, bool(self.cameras))
        if idx is not None:
            raw = env.set_init_state(self.init_states[idx])
        if self.num_steps_wait:
            quiet = self.fast_settle and bool(self.cameras)
            if quiet:
                self._set_cameras_enabled(False)
            try:
                for _ in range(self.num_steps_wait):
                    raw, _, _, _ = env.step(DUMMY_ACTION)
            finally:
                if quiet:
                    self._set_cameras_enabled(True)
            if quiet:
                raw = env.env._get_observations(force_update=True)
        self.current_init_state = idx
        self._done = False
        if self._expert is not None:
            self._expert.reset()
        obs = self._format(raw)
        self._last_obs = obs
        return obs, {"is_success": bool(env.check_success()), "task_id": task.task_id,
                     "init_state": idx, "suite": self.suite}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset()")
        a = checked_action(action, ACTION_DIM)
        raw, _, _, info = self._env.step(a)
        success = bool(self._env.check_success())
        obs = self._format(raw)
        self._last_obs = obs
        self._done = success
        info = dict(info or {})
        info.update(is_success=success, task_id=self.task.task_id, init_state=self.current_init_state)
        return obs, float(success), success, False, info

    def expert_action(self) -> np.ndarray:
        """The scripted expert's action for the current state (:mod:`envs.libero.expert`:
        pick-and-place planned from the simulator's privileged state; float32 [7])."""
        if self._env is None or self._last_obs is None:
            raise RuntimeError("expert_action() before reset()")
        if self._expert is None:
            from envs.libero.expert import PickPlaceExpert
            self._expert = PickPlaceExpert(self)
        return self._expert.action()

    def check_success(self) -> bool:
        return bool(self._ensure_env().check_success())

    def observe(self) -> dict[str, Any]:
        """Re-read the observation after the sim state was changed directly (tests, tools)."""
        raw = self._env.env._get_observations(force_update=True)
        self._last_obs = self._format(raw)
        return self._last_obs

    def render(self):
        return camera_strip(self._last_obs)

    def close(self):
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env = None


def make_libero_env(cfg: dict) -> LiberoEnv:
    """Factory for :mod:`envs.registry` (``name``: a suite, or ``libero`` with ``suite``).
    The keys are documented in ``config/env/libero_*.yaml``."""
    task_id = cfg.get("task_id", 0)
    return LiberoEnv(
        suite_of(cfg),
        task_id if isinstance(task_id, (str, list, tuple)) else int(task_id),
        init_state_id=cfg.get("init_state_id", 0),
        image_size=render_hw(cfg),
        cameras=cameras_of(cfg),
        num_steps_wait=int(cfg.get("num_steps_wait", 10)),
        fast_settle=bool(cfg.get("fast_settle", True)),
        hard_reset=bool(cfg.get("hard_reset", False)),
        render_quality=str(cfg.get("render_quality", "faithful")),
        assets_path=cfg.get("assets_path"),
        assets_tarball=cfg.get("assets_tarball"),
        gl=cfg.get("gl", "auto"),
    )


# Before anyone imports libero.libero (which would prompt for a config on stdin).
ensure_libero_config()
