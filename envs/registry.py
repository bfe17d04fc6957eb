"""Env registry: ``make_env(env_cfg) -> gym.Env`` dispatching on ``env_cfg["name"]``.

A factory takes the env config as a plain dict and returns the *raw* env (observation
space already in the common schema of :mod:`data.core.schema`); :func:`make_env` then adds the
wrappers the config asks for, in this order (innermost first)::

    raw env
    -> ImageTransform          (crop / resize: ``crop``, ``image_size``)
    -> TimeLimit               (``max_episode_steps``, else the env's own default)
    -> RewardClassifierReward  (``reward_classifier: {path, threshold, terminate}``)
    -> SafetyWrapper           (``safety: {clip, workspace_low/high, ...}``)
    -> InterventionWrapper     (``make_env(cfg, intervention=source)``: the actor owns the
                                input device; human actions pass the safety wrapper too)
    -> EpisodeRecorder         (``record_dir``)

Built-in names: ``libero`` (needs ``suite``), ``libero_spatial``, ``libero_object``,
``libero_goal``, ``libero_10``, ``libero_90``, ``gym_hil``, ``robot``, ``reacher``. Register
your own with :func:`register`; an unknown ``name`` first imports ``envs.<name>`` (if that
module exists), so a module can register itself at import.

Headless rendering: :func:`configure_rendering` picks the MuJoCo GL backend (``MUJOCO_GL``
and ``PYOPENGL_PLATFORM``) before any simulator is imported. The simulator factories call it
with the config's ``gl`` key (``auto``, ``egl``, ``osmesa``, ``glfw``); ``auto`` keeps a
backend the user already exported and otherwise prefers OSMesa when its library is present
(much faster than EGL on Mesa's llvmpipe for small images), then EGL.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import warnings
from typing import Any, Callable, Mapping

import gymnasium as gym

Factory = Callable[[dict], gym.Env]

_FACTORIES: dict[str, Factory] = {}

GL_BACKENDS = ("egl", "osmesa", "glfw")


def register(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory(env_cfg: dict) -> gym.Env`` under ``name``."""
    if not overwrite and name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"env {name!r} is already registered; pass overwrite=True to replace it")
    _FACTORIES[name] = factory


def registered() -> list[str]:
    return sorted(_FACTORIES)


def to_dict(env_cfg: Any) -> dict:
    """A plain, resolved dict from a dict or an OmegaConf DictConfig."""
    if env_cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(env_cfg, DictConfig):
            return OmegaConf.to_container(env_cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(env_cfg, Mapping):
        raise TypeError(f"env config must be a mapping, got {type(env_cfg).__name__}")
    return dict(env_cfg)


def _factory(name: str) -> Factory:
    if name not in _FACTORIES and name.isidentifier():
        # a module envs/<name>.py may register itself on import
        import importlib

        try:
            importlib.import_module(f"envs.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"envs.{name}":
                raise
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(registered())}") from None


def make_raw_env(env_cfg: Any) -> gym.Env:
    """The env the factory builds, without the config-driven wrappers."""
    cfg = to_dict(env_cfg)
    name = cfg.get("name")
    if not name:
        raise ValueError(f"env config has no 'name': {cfg}")
    return _factory(str(name))(cfg)


def make_env(env_cfg: Any, *, intervention=None,
             intervention_kwargs: Mapping[str, Any] | None = None) -> gym.Env:
    """Build the env named by ``env_cfg["name"]`` and wrap it as the config says.

    ``intervention``: an :class:`envs.intervention.InterventionSource` (started) to put
    between the safety wrapper (so human actions are made safe too) and the recorder.
    """
    cfg = to_dict(env_cfg)
    env = make_raw_env(cfg)
    from envs import wrappers as W

    crop = cfg.get("crop")
    size = cfg.get("image_size")
    if crop or (size and not _images_already(env, size)):
        env = W.ImageTransform(env, size=size, crop=crop)

    limit = cfg.get("max_episode_steps")
    if limit is None:
        limit = getattr(env.unwrapped, "default_max_episode_steps", None)
    if limit and not W.has_time_limit(env):
        env = W.TimeLimit(env, int(limit))

    rc = cfg.get("reward_classifier")
    if rc:
        rc = {"path": rc} if isinstance(rc, str) else dict(rc)
        env = W.RewardClassifierReward(env, rc["path"], threshold=rc.get("threshold"),
                                       terminate=bool(rc.get("terminate", True)))

    safety = cfg.get("safety")
    if safety:
        env = W.SafetyWrapper(env, **safety)

    if intervention is not None:
        from envs.intervention import InterventionWrapper

        env = InterventionWrapper(env, intervention, **dict(intervention_kwargs or {}))

    record_dir = cfg.get("record_dir")
    if record_dir:
        env = W.EpisodeRecorder(env, record_dir)
    return env


def _images_already(env: gym.Env, size) -> bool:
    from data.core.schema import OBS_IMAGE_PREFIX

    hw = (size, size) if isinstance(size, int) else tuple(size)
    shapes = [tuple(s.shape[:2]) for k, s in env.observation_space.spaces.items()
              if k.startswith(OBS_IMAGE_PREFIX)]
    return all(s == tuple(hw) for s in shapes)


# ---------------------------------------------------------------- headless rendering

def _have_lib(name: str) -> bool:
    return ctypes.util.find_library(name) is not None


def configure_rendering(backend: str | None = "auto") -> str:
    """Set ``MUJOCO_GL``/``PYOPENGL_PLATFORM`` for headless rendering; return the backend.

    Must run before ``mujoco`` (or robosuite / OpenGL) is imported to take effect. With
    ``auto`` an exported ``MUJOCO_GL`` wins; otherwise OSMesa if ``libOSMesa`` is installed
    (Debian ``libosmesa6``), else EGL (Debian ``libegl1`` + ``libgl1-mesa-dri``).
    """
    backend = (backend or "auto").lower()
    current = os.environ.get("MUJOCO_GL", "").lower()
    if backend == "auto":
        if current:
            backend = current
        elif _have_lib("OSMesa"):
            backend = "osmesa"
        elif _have_lib("EGL"):
            backend = "egl"
        else:
            raise RuntimeError(
                "no headless OpenGL found: install Debian libosmesa6 (OSMesa) or libegl1 + "
                "libgl1-mesa-dri (EGL), or export MUJOCO_GL"
            )
    if backend not in GL_BACKENDS:
        raise ValueError(f"gl backend must be one of auto, {', '.join(GL_BACKENDS)}; got {backend!r}")
    glmod = sys.modules.get("mujoco.rendering.classic.gl_context")
    chosen = getattr(glmod, "_MUJOCO_GL", None) if glmod is not None else None
    if chosen is not None and chosen != backend and not (chosen in ("", "glfw") and backend == "glfw"):
        raise RuntimeError(
            f"MuJoCo was already imported with MUJOCO_GL={chosen or '(unset: GLFW)'}; it cannot switch "
            f"to {backend} in this process. Import envs.registry (or export MUJOCO_GL={backend}) "
            "before anything imports mujoco."
        )
    if current and current != backend:
        warnings.warn(f"MUJOCO_GL={current} from the environment is replaced by {backend}", stacklevel=2)
    os.environ["MUJOCO_GL"] = backend
    if backend in ("egl", "osmesa"):
        plat = os.environ.get("PYOPENGL_PLATFORM", "").lower()
        if plat and plat != backend and "OpenGL" in sys.modules:
            raise RuntimeError(
                f"PyOpenGL was already imported with PYOPENGL_PLATFORM={plat}; cannot use {backend}"
            )
        os.environ["PYOPENGL_PLATFORM"] = backend
    else:
        os.environ.pop("PYOPENGL_PLATFORM", None)
    return backend


# Headless by default: pick the GL backend now, before anything imports mujoco (a user who
# wants an on-screen viewer exports MUJOCO_GL=glfw).
if "MUJOCO_GL" not in os.environ and "mujoco" not in sys.modules:
    try:
        configure_rendering("auto")
    except RuntimeError:  # no OpenGL library at all: state-only envs still work
        pass


# ---------------------------------------------------------------- built-in factories

def _libero_factory(suite: str | None = None) -> Factory:
    def factory(cfg: dict) -> gym.Env:
        from envs.libero import make_libero_env

        if suite is not None:
            cfg = {**cfg, "suite": cfg.get("suite") or suite}
        return make_libero_env(cfg)

    return factory


def _gym_hil_factory(cfg: dict) -> gym.Env:
    from envs.gym_hil import make_gym_hil_env

    return make_gym_hil_env(cfg)


def _robot_factory(cfg: dict) -> gym.Env:
    from envs.robot import make_robot_env

    return make_robot_env(cfg)


register("libero", _libero_factory())
for _suite in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"):
    register(_suite, _libero_factory(_suite))
register("gym_hil", _gym_hil_factory)
register("robot", _robot_factory)


def _reacher_factory(cfg: dict) -> gym.Env:
    # The demo task (gym.make adds its TimeLimit, so make_env adds none).
    from envs.reacher import make_reacher_env

    return make_reacher_env(max_episode_steps=int(cfg.get("max_episode_steps") or 50),
                            success_threshold=float(cfg.get("success_threshold", 0.05)))


register("reacher", _reacher_factory)


def _pendulum_factory(cfg: dict) -> gym.Env:
    # The demo task: gymnasium's MuJoCo InvertedPendulum in the Tandem layout (envs/reacher.py).
    from envs.reacher import make_inverted_pendulum_env

    return make_inverted_pendulum_env(max_episode_steps=int(cfg.get("max_episode_steps") or 100),
                                      success_steps=cfg.get("success_steps"))


register("inverted_pendulum", _pendulum_factory)
