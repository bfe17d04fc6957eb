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

Reward: 1.0 on success (gym-hil's sparse reward), which terminates; pushing the object out
of the workspace also terminates (``info["is_success"]`` False, ``info["out_of_bounds"]``
True). gym-hil's 100-step limit (10 s at 10 Hz) is ``default_max_episode_steps``.

Speed: gym-hil renders with a 4096 shadow map and 8x multisampling, which cost a software
renderer dearly; ``render_quality: fast`` (default) sets the shadow map size and the
multisample count to 0 and rebuilds the renderer (no shadows, aliased edges);
``faithful`` keeps gym-hil's look. Measured (2 cameras, Mesa llvmpipe, shared 2-vCPU VM,
``python -m envs.gym_hil``): fast ~10 steps/s wall / ~19 per CPU-second at 128x128 (OSMesa),
~16 at 256x256; faithful ~1 per CPU-second; state only (``cameras: {}``) ~140. The render
cost is almost all per-triangle work on the robot meshes, so image size matters little.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.wrappers import TEXT_SPACE

TASKS: dict[str, dict[str, Any]] = {
    "PandaPickCube": {"instruction": "pick up the cube", "max_steps": 100},
    "PandaArrangeBoxes": {"instruction": "push each box onto its target", "max_steps": 100},
}
DEFAULT_CAMERAS = {"front": "front", "wrist": "wrist"}
MAX_GRIPPER_COMMAND = 255.0


def canonical_task(name: str) -> str:
    """``gym_hil/PandaPickCubeBase-v0`` / ``PandaPickCube-v0`` / ``PandaPickCube`` -> ``PandaPickCube``."""
    n = name.split("/")[-1]
    for suffix in ("-v0", "Base", "Keyboard", "Gamepad", "Viewer"):
        n = n.removesuffix(suffix)
    if n not in TASKS:
        raise ValueError(f"unknown gym-hil task {name!r}; one of {', '.join(TASKS)}")
    return n


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
        max_episode_steps: int | None = None,
        gl: str | None = "auto",
        render_mode: str | None = "rgb_array",
    ):
        from envs.registry import configure_rendering

        configure_rendering(gl)
        import mujoco
        from gym_hil.mujoco_gym_env import GymRenderingSpec

        self.task_name = canonical_task(task)
        self.instruction = TASKS[self.task_name]["instruction"]
        self.default_max_episode_steps = int(max_episode_steps or TASKS[self.task_name]["max_steps"])
        h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.image_hw = (int(h), int(w))
        self.cameras = dict(DEFAULT_CAMERAS if cameras is None else cameras)
        unknown = set(self.cameras) - set(DEFAULT_CAMERAS)
        if unknown:
            raise ValueError(f"gym-hil cameras are {sorted(DEFAULT_CAMERAS)}, got {sorted(unknown)}")
        image_obs = bool(self.cameras)
        self.include_env_state = (not image_obs) if include_env_state is None else bool(include_env_state)
        spec = GymRenderingSpec(height=self.image_hw[0], width=self.image_hw[1])
        if self.task_name == "PandaPickCube":
            from gym_hil.envs import PandaPickCubeGymEnv

            self._env = PandaPickCubeGymEnv(render_spec=spec, image_obs=image_obs,
                                            random_block_position=random_block_position)
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

        self._state_dim = 18 + (self._env_state().shape[0] if self.include_env_state else 0)
        obs_spaces: dict[str, spaces.Space] = {
            OBS_STATE: spaces.Box(-np.inf, np.inf, (self._state_dim,), np.float32)
        }
        for key in self.cameras.values():
            obs_spaces[OBS_IMAGE_PREFIX + key] = spaces.Box(0, 255, (*self.image_hw, 3), np.uint8)
        obs_spaces[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
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
        super().reset(seed=seed)
        # gym-hil samples object positions from numpy's global RNG: seed it from this env's
        # RNG (reproducible with reset(seed=...)) and restore it afterwards.
        saved = np.random.get_state()
        np.random.seed(int(self.np_random.integers(2**31 - 1)))
        try:
            raw, _ = self._env.reset()
        finally:
            np.random.set_state(saved)
        self._done = False
        self._last_obs = self._format(raw)
        return self._last_obs, {"is_success": False}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset()")
        a = np.asarray(action, dtype=np.float64).reshape(4)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"non-finite action {a}")
        a = np.clip(a, -1.0, 1.0)
        raw_action = np.concatenate([a[:3] * self._step_size, np.zeros(3), a[3:4]])
        raw, rew, terminated, truncated, info = self._env.step(raw_action)
        success = bool(info.get("succeed", rew >= 1.0))
        terminated = bool(terminated)
        self._done = terminated or bool(truncated)
        self._last_obs = self._format(raw)
        info = {"is_success": success, "out_of_bounds": terminated and not success}
        return self._last_obs, float(success), terminated, bool(truncated), info

    def render(self):
        if self._last_obs is None:
            return None
        imgs = [v for k, v in self._last_obs.items() if k.startswith(OBS_IMAGE_PREFIX)]
        if imgs:
            return np.concatenate(imgs, axis=1)
        return self._env.render()[0]

    def close(self):
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None


def make_gym_hil_env(cfg: dict) -> GymHilEnv:
    """Factory for :mod:`envs.registry` (``name: gym_hil``, ``task: PandaPickCube``)."""
    size = cfg.get("render_size") or cfg.get("image_size") or 128
    if isinstance(size, list):
        size = tuple(size)
    step = cfg.get("ee_step_size", 0.025)
    if isinstance(step, list):
        step = tuple(step)
    return GymHilEnv(
        cfg.get("task", "PandaPickCube"),
        image_size=size,
        cameras=cfg.get("cameras"),
        ee_step_size=step,
        random_block_position=bool(cfg.get("random_block_position", True)),
        include_env_state=cfg.get("include_env_state"),
        render_quality=str(cfg.get("render_quality", "fast")),
        max_episode_steps=cfg.get("task_max_steps"),
        gl=cfg.get("gl", "auto"),
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
