"""Env registry: ``make_env(env_cfg) -> gym.Env`` and ``env_spec(env_cfg) -> EnvSpec``,
dispatching on ``env_cfg["name"]``.

A factory takes the env config as a plain dict and returns the *raw* env (observation
space already in the common schema of :mod:`data.core.schema`); :func:`make_env` then adds the
wrappers the config asks for, in this order (innermost first)::

    raw env
    -> ImageTransform          (crop / resize: ``crop``, ``image_size``)
    -> TimeLimit               (``max_episode_steps``, else the env's own default)
    -> RewardClassifierReward  (``reward_classifier: {path, threshold, terminate, coef, env_coef}``)
    -> SafetyWrapper           (``safety: {clip, workspace_low/high, ...}``)
    -> InterventionWrapper     (``make_env(cfg, intervention=source)``: the actor owns the
                                input device; human actions pass the safety wrapper too)
    -> EpisodeRecorder         (``record_dir``)

:func:`env_spec` is what ``spec_from_env(make_env(cfg))`` (:mod:`envs.spec`) gives, computed
from the config alone, so a learner gets the layout without importing or running a
simulator: the env's static spec function (registered beside its factory; each lives in a
module that imports no simulator) gives the raw env's layout, and the wrappers' effect
(``crop`` / ``image_size``, ``max_episode_steps``) is applied to it. An explicit ``spec:``
block in the env config (``state_dim``, ``action_dim``, ``cameras: {name: [H, W, 3]}``,
``has_task``, ``max_episode_steps``; ``default_max_episode_steps`` is read too, the robot
driver's name for it) wins over the static spec function. It describes the raw env, as the
driver or simulator produces it; ``crop``/``image_size``/``max_episode_steps`` in the config
still apply on top. ``robot`` has no static layout (it comes from the driver) and requires
the block.

Built-in names: ``libero`` (needs ``suite``), ``libero_spatial``, ``libero_object``,
``libero_goal``, ``libero_10``, ``libero_90``, ``gym_hil``, ``robot``, ``reacher``,
``inverted_pendulum``, ``point_reach``. Register your own with :func:`register`; an unknown
``name`` first imports ``envs.<name>`` (if that module exists), so a module can register
itself at import.

Importing this module picks the headless GL backend (:mod:`envs.rendering`) before any
simulator is imported; it imports neither a simulator nor gymnasium itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec
from envs import rendering  # noqa: F401  (picks MUJOCO_GL before any simulator import)

if TYPE_CHECKING:  # pragma: no cover
    import gymnasium as gym

Factory = Callable[[dict], "gym.Env"]
SpecFn = Callable[[dict], EnvSpec]

_FACTORIES: dict[str, Factory] = {}
_SPECS: dict[str, SpecFn] = {}

LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")


def register(name: str, factory: Factory, *, spec: SpecFn | None = None,
             overwrite: bool = False) -> None:
    """Register ``factory(env_cfg: dict) -> gym.Env`` under ``name``.

    ``spec(env_cfg: dict) -> EnvSpec``: the layout of the env ``factory`` builds from that
    config, before the config-driven wrappers (:func:`env_spec` adds their effect), computed
    without building it. Without one, :func:`env_spec` needs a ``spec:`` block in the config.
    """
    if not overwrite and name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"env {name!r} is already registered; pass overwrite=True to replace it")
    _FACTORIES[name] = factory
    if spec is not None:
        _SPECS[name] = spec
    else:
        _SPECS.pop(name, None)


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


def _name(cfg: dict) -> str:
    name = cfg.get("name")
    if not name:
        raise ValueError(f"env config has no 'name': {cfg}")
    name = str(name)
    if name not in _FACTORIES and name.isidentifier():
        # a module envs/<name>.py may register itself on import
        try:
            importlib.import_module(f"envs.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"envs.{name}":
                raise
    if name not in _FACTORIES:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(registered())}")
    return name


def make_raw_env(env_cfg: Any) -> "gym.Env":
    """The env the factory builds, without the config-driven wrappers."""
    cfg = to_dict(env_cfg)
    return _FACTORIES[_name(cfg)](cfg)


def make_env(env_cfg: Any, *, intervention=None,
             intervention_kwargs: Mapping[str, Any] | None = None) -> "gym.Env":
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

    # 0 / null: the env's own limit (as env_spec reads it)
    limit = cfg.get("max_episode_steps") or getattr(env.unwrapped, "default_max_episode_steps", None)
    if limit and not W.has_time_limit(env):
        env = W.TimeLimit(env, int(limit))

    rc = cfg.get("reward_classifier")
    if rc:
        rc = {"path": rc} if isinstance(rc, str) else dict(rc)
        unknown = sorted(set(rc) - {"path", "threshold", "terminate", "coef", "env_coef"})
        if unknown:
            raise ValueError(f"reward_classifier: unknown key(s) {unknown} (path, threshold, terminate, "
                             "coef, env_coef)")
        env = W.RewardClassifierReward(env, rc["path"], threshold=rc.get("threshold"),
                                       terminate=bool(rc.get("terminate", True)),
                                       coef=rc.get("coef", 1.0), env_coef=rc.get("env_coef", 0.0))

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


def _hw(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


def _images_already(env: "gym.Env", size) -> bool:
    from data.core.schema import OBS_IMAGE_PREFIX

    shapes = [tuple(s.shape[:2]) for k, s in env.observation_space.spaces.items()
              if k.startswith(OBS_IMAGE_PREFIX)]
    return all(s == _hw(size) for s in shapes)


# ---------------------------------------------------------------- specs without a simulator

def spec_from_block(block: Any, env_name: str = "env") -> EnvSpec:
    """An :class:`EnvSpec` from a config's ``spec:`` block (extra keys, e.g. the robot
    driver's ``action_low`` or ``ee_pos_index``, are ignored)."""
    if not isinstance(block, Mapping):
        raise ValueError(f"env {env_name!r}: spec must be a mapping with state_dim, action_dim, "
                         f"cameras, has_task, max_episode_steps; got {block!r}")
    missing = [k for k in ("state_dim", "action_dim") if block.get(k) is None]
    if missing:
        raise ValueError(f"env {env_name!r}: the spec block lacks {', '.join(missing)}")
    steps = block.get("max_episode_steps") or block.get("default_max_episode_steps") or 0
    return EnvSpec.from_dict({**block, "max_episode_steps": steps, "extras": {}})


def raw_env_spec(env_cfg: Any) -> EnvSpec:
    """The layout of :func:`make_raw_env`'s env (no wrappers), from the config alone."""
    cfg = to_dict(env_cfg)
    name = _name(cfg)
    if cfg.get("spec") is not None:
        return spec_from_block(cfg["spec"], name)
    fn = _SPECS.get(name)
    if fn is None:
        raise ValueError(f"env {name!r} has no static spec: add a spec: block (state_dim, "
                         f"action_dim, cameras, has_task, max_episode_steps) to its env config, "
                         f"or register it with register(..., spec=fn)")
    return fn(cfg)


def env_spec(env_cfg: Any) -> EnvSpec:
    """``spec_from_env(make_env(env_cfg))`` without building the env (see the module doc)."""
    cfg = to_dict(env_cfg)
    raw = raw_env_spec(cfg)
    crop, size = cfg.get("crop"), cfg.get("image_size")
    cameras = dict(raw.cameras)
    if crop or (size and any(shape[:2] != _hw(size) for shape in cameras.values())):
        cameras = {cam: _transformed(shape, crop, size, cam) for cam, shape in cameras.items()}
    steps = cfg.get("max_episode_steps") or raw.max_episode_steps or 0
    # value ranges a record's float fields must keep (ingest refuses others); unset: the default
    ranges = {name: tuple(cfg[key]) for key, name in
              (("reward_range", "reward"), ("action_range", "action"), ("state_range", OBS_STATE))
              if cfg.get(key) is not None}
    return EnvSpec(state_dim=raw.state_dim, action_dim=raw.action_dim, cameras=cameras,
                   has_task=raw.has_task, max_episode_steps=int(steps), extras=dict(raw.extras),
                   float_ranges=ranges)


def _transformed(shape: tuple[int, int, int], crop, size, cam: str) -> tuple[int, int, int]:
    """A camera's [H, W, 3] after :class:`envs.wrappers.ImageTransform` (crop, then resize)."""
    c = crop.get(cam) if isinstance(crop, Mapping) else crop
    if c is not None:
        import numpy as np

        from envs import wrappers as W

        blank = np.broadcast_to(np.zeros((), np.uint8), tuple(shape))  # no memory: a view
        shape = W.crop_image(blank, c).shape
    if size:
        shape = (*_hw(size), shape[2])
    return tuple(int(x) for x in shape)


# ---------------------------------------------------------------- built-in envs

def _lazy(module: str, attr: str, **fixed: Any) -> Callable[[dict], Any]:
    """``module.attr(cfg)``, imported on first call (so this module imports no env);
    ``fixed`` keys fill in config values left empty (a suite name's ``suite``)."""
    def call(cfg: dict):
        cfg = {**cfg, **{k: cfg.get(k) or v for k, v in fixed.items()}}
        return getattr(importlib.import_module(module), attr)(cfg)

    call.__qualname__ = call.__name__ = f"{module}.{attr}"
    return call


def _robot_spec(cfg: dict) -> EnvSpec:
    raise ValueError(
        "env 'robot' gets its layout from the robot driver, which env_spec does not contact: add "
        "a spec: block to the env config, e.g. spec: {state_dim: 18, action_dim: 4, cameras: "
        "{front: [480, 640, 3]}, has_task: true, default_max_episode_steps: 100} (the driver's "
        "'describe' reply has these values); it is checked against the driver on reset")


register("libero", _lazy("envs.libero.env", "make_libero_env"),
         spec=_lazy("envs.libero.spec", "libero_spec"))
for _suite in LIBERO_SUITES:
    register(_suite, _lazy("envs.libero.env", "make_libero_env", suite=_suite),
             spec=_lazy("envs.libero.spec", "libero_spec", suite=_suite))
register("gym_hil", _lazy("envs.gym_hil", "make_gym_hil_env"),
         spec=_lazy("envs.gym_hil", "gym_hil_spec"))
register("robot", _lazy("envs.robot", "make_robot_env"), spec=_robot_spec)
register("reacher", _lazy("envs.reacher", "reacher_from_config"),
         spec=_lazy("envs.reacher", "reacher_spec"))
register("inverted_pendulum", _lazy("envs.pendulum", "pendulum_from_config"),
         spec=_lazy("envs.pendulum", "pendulum_spec"))
register("point_reach", _lazy("envs.point_reach", "point_reach_from_config"),
         spec=_lazy("envs.point_reach", "point_reach_spec"))
