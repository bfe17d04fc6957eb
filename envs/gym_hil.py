"""gym-hil's MuJoCo Panda tasks as headless gymnasium envs in the common schema.

Tasks: ``PandaPickCube`` (lift the cube 10 cm) and ``PandaArrangeBoxes`` (push each box onto
its target), i.e. gym-hil's ``gym_hil/PandaPickCube*-v0`` and ``gym_hil/PandaArrangeBoxes*-v0``
without their viewer / keyboard / gamepad wrappers (Tandem's own intervention sources
replace those; see :mod:`envs.intervention`).

Observation::

    "observation.state"        float32 [18]  joint pos (7), joint vel (7), gripper command
                                             (1, 0..255), TCP position (3); with
                                             ``include_env_state`` the object positions follow
    "observation.images.front" uint8 [H, W, 3]
    "observation.images.wrist" uint8 [H, W, 3]
    "task"                     str

Action: float32 Box [-1, 1]^4 = (dx, dy, dz, gripper): the end-effector target moves by
``ee_step_size`` metres per unit (gym-hil's default 0.025, as its EEActionWrapper) and the
gripper command moves by ``gripper`` (-1 opens, +1 closes, 0 holds), as gym-hil's
``EEActionWrapper`` does with its [0, 2] gripper range shifted to [-1, 1].

Reward: 1.0 on success (gym-hil's sparse reward, ``reward_type: sparse``, the default), which
terminates; pushing the object out of the workspace also terminates (``info["is_success"]``
False, ``info["out_of_bounds"]`` True). ``reward_type: dense`` (PandaPickCube only) passes
gym-hil's own dense reward through: ``0.3 * exp(-20 * |cube - TCP|) + 0.7 * clip(lift / 0.1 m,
0, 1)`` at every step; success (gym-hil's: the TCP within 5 cm of the cube and the cube lifted
10 cm) still terminates and sets ``info["is_success"]``. gym-hil's 100-step limit (10 s at 10 Hz) is ``default_max_episode_steps``.

Resets: gym-hil places the objects at random (numpy's global RNG, seeded here from the env's
own, so ``reset(seed=s)`` reproduces a placement). A learner's job resets with
``options={"task_id": 0, "init_state": i}``: one task per env, so ``task_id`` must be 0;
``init_state`` fixes the placement (drawn from an RNG seeded by ``i``, whatever the seed;
see :mod:`envs.reset_options`). ``info["task_id"]`` and ``info["init_state"]`` (None without
one) report them.

:func:`gym_hil_spec` gives the layout from a config without importing gym-hil or MuJoCo
(both are imported when an env is built).

Speed: gym-hil renders with a 4096 shadow map and 8x multisampling, which cost a software
renderer dearly; ``render_quality: fast`` (default) sets the shadow map size and the
multisample count to 0 and rebuilds the renderer (no shadows, aliased edges);
``faithful`` keeps gym-hil's look. The render cost is mostly per-triangle work on the robot
meshes, so image size matters little. ``python -m envs.gym_hil`` times the steps; current
figures: docs/benchmarks.md, "Environments".
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.spec import EnvSpec
from envs.rendering import configure_rendering
from envs.spec import camera_strip, checked_action
from envs.reset_options import init_state_seed, single_task_init_state
from envs.wrappers import TEXT_SPACE

#: env_state_dim: the object positions ``include_env_state`` appends (3 per object)
TASKS: dict[str, dict[str, Any]] = {
    "PandaPickCube": {"instruction": "pick up the cube", "max_steps": 100, "env_state_dim": 3},
    "PandaArrangeBoxes": {"instruction": "push each box onto its target", "max_steps": 100,
                          "env_state_dim": 15},
}
DEFAULT_CAMERAS = {"front": "front", "wrist": "wrist"}
ROBOT_STATE_DIM = 18
ACTION_DIM = 4
DEFAULT_IMAGE_SIZE = 128
MAX_GRIPPER_COMMAND = 255.0


def canonical_task(name: str) -> str:
    """``gym_hil/PandaPickCubeBase-v0`` / ``PandaPickCube-v0`` / ``PandaPickCube`` -> ``PandaPickCube``."""
    n = name.split("/")[-1]
    for suffix in ("-v0", "Base", "Keyboard", "Gamepad", "Viewer"):
        n = n.removesuffix(suffix)
    if n not in TASKS:
        raise ValueError(f"unknown gym-hil task {name!r}; one of {', '.join(TASKS)}")
    return n


def _image_hw(size) -> tuple[int, int]:
    if isinstance(size, int):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


def _check_cameras(cameras: Mapping[str, str] | None) -> dict[str, str]:
    cams = dict(DEFAULT_CAMERAS if cameras is None else cameras)
    unknown = set(cams) - set(DEFAULT_CAMERAS)
    if unknown:
        raise ValueError(f"gym-hil cameras are {sorted(DEFAULT_CAMERAS)}, got {sorted(unknown)}")
    return cams


def _include_env_state(include_env_state: bool | None, cameras: Mapping[str, str]) -> bool:
    """Default: object positions in the state only for a state-only env."""
    return (not cameras) if include_env_state is None else bool(include_env_state)


def _render_size(cfg: Mapping[str, Any]):
    size = cfg.get("render_size") or cfg.get("image_size") or DEFAULT_IMAGE_SIZE
    return tuple(size) if isinstance(size, list) else size


def gym_hil_spec(cfg: Mapping[str, Any]) -> EnvSpec:
    """The layout :func:`make_gym_hil_env` gives for ``cfg`` (before the config-driven
    wrappers), without gym-hil or MuJoCo."""
    task = canonical_task(cfg.get("task", "PandaPickCube"))
    cams = _check_cameras(cfg.get("cameras"))
    h, w = _image_hw(_render_size(cfg))
    env_state = TASKS[task]["env_state_dim"] if _include_env_state(cfg.get("include_env_state"), cams) else 0
    return EnvSpec(state_dim=ROBOT_STATE_DIM + env_state, action_dim=ACTION_DIM,
                   cameras={key: (h, w, 3) for key in cams.values()}, has_task=True,
                   max_episode_steps=int(TASKS[task]["max_steps"]))


class GymHilEnv(gym.Env):
    """One gym-hil Panda task, headless, in the common observation schema."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
    ee_pos_index = (15, 16, 17)     # TCP position in observation.state (for SafetyWrapper)
    action_pos_index = (0, 1, 2)

    def __init__(
        self,
        task: str = "PandaPickCube",
        *,
        image_size: int | tuple[int, int] = 128,
        cameras: dict[str, str] | None = None,
        ee_step_size: float | tuple[float, float, float] = 0.025,
        random_block_position: bool = True,
        include_env_state: bool | None = None,
        render_quality: str = "fast",
        gl: str | None = "auto",
        render_mode: str | None = "rgb_array",
        reward_type: str = "sparse",
    ):
        configure_rendering(gl)
        import mujoco
        from gym_hil.mujoco_gym_env import GymRenderingSpec

        self.task_name = canonical_task(task)
        self.instruction = TASKS[self.task_name]["instruction"]
        self.default_max_episode_steps = int(TASKS[self.task_name]["max_steps"])
        if reward_type not in ("sparse", "dense"):
            raise ValueError(f"reward_type must be sparse or dense, got {reward_type!r}")
        if reward_type == "dense" and self.task_name != "PandaPickCube":
            raise ValueError("reward_type dense: gym-hil has a dense reward for PandaPickCube only")
        self.reward_type = reward_type
        self.image_hw = h, w = _image_hw(image_size)
        self.cameras = _check_cameras(cameras)
        image_obs = bool(self.cameras)
        self.include_env_state = _include_env_state(include_env_state, self.cameras)
        spec = GymRenderingSpec(height=self.image_hw[0], width=self.image_hw[1])
        if self.task_name == "PandaPickCube":
            from gym_hil.envs import PandaPickCubeGymEnv

            self._env = PandaPickCubeGymEnv(render_spec=spec, image_obs=image_obs,
                                            random_block_position=random_block_position,
                                            reward_type=reward_type)
        else:
            from gym_hil.envs import PandaArrangeBoxesGymEnv

            self._env = PandaArrangeBoxesGymEnv(render_spec=spec, image_obs=image_obs)
        if render_quality not in ("fast", "faithful"):
            raise ValueError(f"render_quality must be fast or faithful, got {render_quality!r}")
        self.render_quality = render_quality
        if render_quality == "fast":
            # Shadow map and multisample buffers are sized when the renderer's GL context is
            # made, so rebuild the renderer after changing them.
            self._env._viewer.close()
            self._env.model.vis.quality.shadowsize = 0
            self._env.model.vis.quality.offsamples = 0
            self._env._viewer = mujoco.Renderer(self._env.model, height=h, width=w)
        self._step_size = np.broadcast_to(np.asarray(ee_step_size, dtype=np.float64), (3,)).copy()
        self.render_mode = render_mode
        self._last_obs: dict[str, Any] | None = None
        self._done = True

        env_state = self._env_state().shape[0]
        if env_state != TASKS[self.task_name]["env_state_dim"]:  # gym-hil changed its scene
            raise RuntimeError(f"gym-hil {self.task_name} has {env_state} object coordinates, "
                               f"TASKS says {TASKS[self.task_name]['env_state_dim']}")
        self._state_dim = ROBOT_STATE_DIM + (env_state if self.include_env_state else 0)
        obs_spaces: dict[str, spaces.Space] = {
            OBS_STATE: spaces.Box(-np.inf, np.inf, (self._state_dim,), np.float32)
        }
        for key in self.cameras.values():
            obs_spaces[OBS_IMAGE_PREFIX + key] = spaces.Box(0, 255, (*self.image_hw, 3), np.uint8)
        obs_spaces[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self.spec = gym.envs.registration.EnvSpec(
            id=f"tandem/gym_hil-{self.task_name}-v0", entry_point="envs.gym_hil:GymHilEnv",
        )

    @property
    def sim(self):
        """The gym-hil env (its ``model`` and ``data`` are MuJoCo's)."""
        return self._env

    def _env_state(self) -> np.ndarray:
        d = self._env.data
        if self.task_name == "PandaPickCube":
            return d.sensor("block_pos").data.astype(np.float32)
        n = self._env.no_blocks
        return np.concatenate([d.sensor(f"block{i}_pos").data for i in range(1, n + 1)]).astype(np.float32)

    def _format(self, raw: dict) -> dict[str, Any]:
        state = np.asarray(raw["agent_pos"], dtype=np.float32)
        if self.include_env_state:
            state = np.concatenate([state, self._env_state()])
        obs: dict[str, Any] = {OBS_STATE: state}
        pixels = raw.get("pixels", {})
        for cam, key in self.cameras.items():
            obs[OBS_IMAGE_PREFIX + key] = np.ascontiguousarray(pixels[cam])
        obs[TASK] = self.instruction
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """``options``: a learner's job, ``task_id`` 0 and ``init_state`` (see the module
        docstring)."""
        init_state = single_task_init_state(options, f"gym_hil {self.task_name}")
        super().reset(seed=seed)
        # gym-hil samples object positions from numpy's global RNG: seed it from this env's
        # RNG (reproducible with reset(seed=...)), or from init_state, and restore it after.
        if init_state is None:
            layout_seed = int(self.np_random.integers(2**31 - 1))
        else:
            layout_seed = init_state_seed(init_state)
        saved = np.random.get_state()
        np.random.seed(layout_seed)
        try:
            raw, _ = self._env.reset()
        finally:
            np.random.set_state(saved)
        self._done = False
        self._last_obs = self._format(raw)
        return self._last_obs, {"is_success": False, "task_id": 0, "init_state": init_state}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset()")
        a = checked_action(action, ACTION_DIM)
        raw_action = np.concatenate([a[:3] * self._step_size, np.zeros(3), a[3:4]])
        raw, rew, terminated, truncated, info = self._env.step(raw_action)
        success = bool(info.get("succeed", rew >= 1.0))
        terminated = bool(terminated)
        self._done = terminated or bool(truncated)
        self._last_obs = self._format(raw)
        info = {"is_success": success, "out_of_bounds": terminated and not success}
        reward = float(rew) if self.reward_type == "dense" else float(success)
        return self._last_obs, reward, terminated, bool(truncated), info

    def render(self):
        if self._last_obs is None:
            return None
        strip = camera_strip(self._last_obs)
        return strip if strip is not None else self._env.render()[0]

    def close(self):
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None


def make_gym_hil_env(cfg: dict) -> GymHilEnv:
    """Factory for :mod:`envs.registry` (``name: gym_hil``, ``task: PandaPickCube``); the
    keys are documented in ``config/env/gym_hil_*.yaml``."""
    step = cfg.get("ee_step_size", 0.025)
    if isinstance(step, list):
        step = tuple(step)
    return GymHilEnv(
        cfg.get("task", "PandaPickCube"),
        image_size=_render_size(cfg),
        cameras=cfg.get("cameras"),
        ee_step_size=step,
        random_block_position=bool(cfg.get("random_block_position", True)),
        include_env_state=cfg.get("include_env_state"),
        render_quality=str(cfg.get("render_quality", "fast")),
        gl=cfg.get("gl", "auto"),
        reward_type=str(cfg.get("reward_type", "sparse")),
    )


def _bench(argv: list[str] | None = None) -> None:
    """``python -m envs.gym_hil --gl osmesa --size 128 256``: steps/s."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--task", default="PandaPickCube")
    ap.add_argument("--gl", default="auto")
    ap.add_argument("--size", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--quality", default="fast", choices=["fast", "faithful"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-cameras", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for size in [0] if args.no_cameras else args.size:
        env = GymHilEnv(args.task, image_size=size or 128, cameras={} if args.no_cameras else None,
                        render_quality=args.quality, gl=args.gl)
        import os

        env.reset(seed=0)
        t1, c1 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            _, _, term, trunc, _ = env.step(rng.uniform(-1, 1, 4).astype(np.float32))
            if term or trunc:
                env.reset()
        t2, c2 = time.perf_counter(), time.process_time()
        env.close()
        print(f"{args.task} gl={os.environ.get('MUJOCO_GL')} size={size} quality={args.quality}: "
              f"{args.steps / (t2 - t1):.1f} steps/s (wall; {args.steps / (c2 - c1):.1f} per CPU-second)",
              flush=True)


if __name__ == "__main__":
    _bench()
