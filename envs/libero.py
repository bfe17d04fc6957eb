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

``task_id`` is one task index, a list of them or ``"all"`` (a multi-task env: episode ``k``
uses task ``k mod T``, and switching task rebuilds the scene, ~2-5 s). Reset restores one
of the task's fixed initial states (``init_state_id`` in the config, or
``reset(options={"init_state_id": i, "task_id": t})``; with ``None``, episode ``k`` -- the
reset's seed if given, else a counter -- takes state ``(k div T) mod N``), then runs
``num_steps_wait`` no-op steps (default 10, as OpenVLA-OFT does, so objects settle); these
do not count toward the time limit.

Offline set-up (:func:`prepare_libero`) happens before ``libero`` is first imported:

* ``LIBERO_CONFIG_PATH`` points at a config dir the project writes (so the import never
  calls ``input()``), unless the user already exported one that holds a ``config.yaml``;
* the assets folder is resolved from, in order: the config's ``assets_path`` (a folder) or
  ``assets_tarball`` (extracted once into ``~/.cache/tandem/libero-assets/<sha256>``), the
  variables ``TANDEM_LIBERO_ASSETS`` / ``TANDEM_LIBERO_ASSETS_TARBALL``, LIBERO's own
  locations (``<site-packages>/libero/libero/assets``, ``~/.cache/libero/assets``), and last
  ``../shared/libero-assets.tar.xz`` next to the checkout (CI and dev machines here). If none
  exists this raises with instructions; it never downloads. The folder is handed to LIBERO
  through its ``get_assets_path`` cache, so nothing is written into site-packages.
* the GL backend is chosen by :func:`envs.registry.configure_rendering` (config key ``gl``).

Initial states are read with a restricted unpickler (numpy arrays only), so neither torch
nor ``libero.libero.benchmark`` (which imports torch) is loaded.

Differences from OpenVLA-OFT's loop, on purpose: resets are *soft* by default
(``hard_reset: false``: the scene is not recompiled, 0.3-1.5 s instead of 4-5 s; the
restored state differs from a hard reset's by ~2e-4 in the end-effector pose after the
settle steps); the settle steps are not rendered (``fast_settle``); LIBERO re-samples fixture
placements on every reset (they are not part of the init states) from numpy's global RNG,
which this env seeds from its own RNG, so ``reset(seed=s)`` reproduces a layout.

Rendering cost (2 cameras, Mesa llvmpipe on a shared 2-vCPU VM; ``python -m envs.libero``
measures it): ``faithful`` (LIBERO's 4x multisampling and floor reflections, pixel-identical
to LIBERO's own renders) ~2.4 steps/s wall, ~5 steps per CPU-second at 128x128 with OSMesa;
``fast`` (no multisampling, reflections or shadows) ~8 wall / ~13 per CPU-second; physics
alone ~20 wall / ~42 per CPU-second. 256x256 is only 10-25% slower (software rendering
cost here is mostly per triangle, not per pixel). OSMesa is faster than EGL (llvmpipe)
here, so ``gl: auto`` prefers it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import io
import json
import os
import pickle
import shutil
import tarfile
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.wrappers import TEXT_SPACE

SUITE_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITES = tuple(SUITE_MAX_STEPS)

RENDER_QUALITIES = ("faithful", "fast")
DEFAULT_CAMERAS: dict[str, str] = {"agentview": "image", "robot0_eye_in_hand": "wrist_image"}
STATE_DIM = 8
ACTION_DIM = 7
DUMMY_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)

ASSET_SUBDIRS = ("articulated_objects", "stable_scanned_objects", "turbosquid_objects",
                 "stable_hope_objects", "scenes")

_REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_TARBALL = _REPO_ROOT.parent / "shared" / "libero-assets.tar.xz"


def cache_root() -> Path:
    """``$TANDEM_CACHE_DIR`` or ``$XDG_CACHE_HOME/tandem`` or ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tandem"


# ---------------------------------------------------------------- package paths (no import)

def _libero_pkg_dir() -> Path:
    """``<site-packages>/libero/libero`` found without running ``libero.libero.__init__``."""
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the LIBERO package is not installed (PyPI: hf-libero)")
    return Path(list(spec.submodule_search_locations)[0]) / "libero"


def _task_map() -> dict[str, list[str]]:
    """LIBERO's suite -> task-name map, loaded from its file without importing the package."""
    path = _libero_pkg_dir() / "benchmark" / "libero_suite_task_map.py"
    spec = importlib.util.spec_from_file_location("_tandem_libero_task_map", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod.libero_task_map


def _language_from_name(name: str) -> str:
    """LIBERO's ``grab_language_from_filename`` (benchmark/__init__.py), minus the suffix."""
    if name[0].isupper():  # LIBERO-100 names start with the scene, e.g. KITCHEN_SCENE10_...
        start = name.find("SCENE") + (8 if "SCENE10" in name else 7)
        return " ".join(name[start:].split("_"))
    return " ".join(name.split("_"))


@dataclass(frozen=True)
class LiberoTask:
    suite: str
    task_id: int
    name: str
    language: str
    bddl_file: Path
    init_states_file: Path


def list_tasks(suite: str) -> list[LiberoTask]:
    """The tasks of a suite in LIBERO's default order (task order index 0)."""
    if suite not in SUITE_MAX_STEPS:
        raise ValueError(f"unknown LIBERO suite {suite!r}; one of {', '.join(SUITES)}")
    pkg = _libero_pkg_dir()
    return [
        LiberoTask(suite, i, name, _language_from_name(name),
                   pkg / "bddl_files" / suite / f"{name}.bddl",
                   pkg / "init_files" / suite / f"{name}.pruned_init")
        for i, name in enumerate(_task_map()[suite])
    ]


class _NumpyOnlyUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"init-state file refers to {module}.{name}")
        return super().find_class(module, name)


def load_init_states(path: str | os.PathLike) -> np.ndarray:
    """A LIBERO ``.pruned_init`` file (a ``torch.save`` zip holding one pickled numpy array)
    as a float64 array [N, D], without torch and without unpickling anything but numpy."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if len(names) != 1 or any(n.split("/")[-2:-1] == ["data"] for n in zf.namelist()):
            raise ValueError(f"{path}: not a pickled numpy array in a torch zip file")
        arr = _NumpyOnlyUnpickler(io.BytesIO(zf.read(names[0]))).load()
    if not isinstance(arr, np.ndarray) or arr.ndim != 2:
        raise ValueError(f"{path}: expected a 2-D array of states, got {type(arr).__name__}")
    return arr


# ---------------------------------------------------------------- assets and config

def _file_sha256(path: Path) -> str:
    """sha256 of a file, memoised in the cache by (path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_root() / "libero-assets" / "sha256-memo.json"
    try:
        table = json.loads(memo.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return table[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    table[key] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _find_assets_root(folder: Path) -> Path | None:
    """The folder itself if it holds LIBERO's asset sub-dirs, or its single child that does."""
    if all((folder / d).is_dir() for d in ASSET_SUBDIRS[:4]):
        return folder
    kids = [k for k in folder.iterdir() if k.is_dir()] if folder.is_dir() else []
    if len(kids) == 1 and all((kids[0] / d).is_dir() for d in ASSET_SUBDIRS[:4]):
        return kids[0]
    return None


def extract_assets_tarball(tarball: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Extract a LIBERO assets tarball once into ``<cache>/libero-assets/<sha256>``.

    Safe against concurrent callers (a file lock) and interrupted extractions (extracts into
    a temp dir and renames). Returns the assets root (the folder with ``scenes/`` etc.).
    """
    tarball = Path(tarball).expanduser()
    if not tarball.is_file():
        raise FileNotFoundError(f"LIBERO assets tarball {tarball} does not exist")
    base = Path(cache_dir).expanduser() if cache_dir else cache_root() / "libero-assets"
    digest = _file_sha256(tarball)
    dest = base / digest
    done = dest / ".tandem-complete"
    if not done.exists():
        base.mkdir(parents=True, exist_ok=True)
        with open(base / f"{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=base))
                try:
                    with tarfile.open(tarball) as tf:
                        tf.extractall(tmp, filter="data")
                    root = _find_assets_root(tmp)
                    if root is None:
                        raise ValueError(f"{tarball} holds no LIBERO assets folder ({', '.join(ASSET_SUBDIRS[:4])})")
                    (root / ".tandem-complete").write_text(str(tarball) + "\n")
                    if dest.exists():
                        shutil.rmtree(dest)
                    os.replace(root, dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _asset_dir_ok(p: Path) -> bool:
    return all((p / d).is_dir() for d in ASSET_SUBDIRS[:4])


def resolve_assets(assets_path: str | None = None, assets_tarball: str | None = None) -> Path:
    """Where LIBERO's assets are, extracting a tarball if that is what was given."""
    if assets_path:
        p = Path(assets_path).expanduser()
        if not _asset_dir_ok(p):
            raise FileNotFoundError(
                f"assets_path {p} is not a LIBERO assets folder (needs {', '.join(ASSET_SUBDIRS[:4])})"
            )
        return p.resolve()
    if assets_tarball:
        return extract_assets_tarball(assets_tarball)
    if os.environ.get("TANDEM_LIBERO_ASSETS"):
        return resolve_assets(assets_path=os.environ["TANDEM_LIBERO_ASSETS"])
    if os.environ.get("TANDEM_LIBERO_ASSETS_TARBALL"):
        return extract_assets_tarball(os.environ["TANDEM_LIBERO_ASSETS_TARBALL"])
    for p in (_libero_pkg_dir() / "assets", Path.home() / ".cache" / "libero" / "assets"):
        if _asset_dir_ok(p):
            return p.resolve()
    if DEV_TARBALL.is_file():
        return extract_assets_tarball(DEV_TARBALL)
    raise FileNotFoundError(
        "LIBERO assets not found and Tandem never downloads them at run time. Give the env "
        "config an assets_path (a LIBERO assets folder, e.g. one downloaded with LIBERO's "
        "download script) or an assets_tarball (a .tar.* of that folder), or export "
        "TANDEM_LIBERO_ASSETS / TANDEM_LIBERO_ASSETS_TARBALL."
    )


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_prepared_assets: Path | None = None
_prepare_lock = threading.Lock()


def ensure_libero_config(assets: Path | None = None) -> Path | None:
    """Point ``LIBERO_CONFIG_PATH`` at a project-written ``config.yaml`` (unless the user
    exported one that exists), so that ``import libero.libero`` never calls ``input()``.
    Runs when this module is imported; cheap (no assets needed: LIBERO ignores the
    ``assets`` key, it is written for tools that read it)."""
    user_cfg = os.environ.get("LIBERO_CONFIG_PATH")
    if user_cfg and (Path(user_cfg) / "config.yaml").is_file() and not os.environ.get("_TANDEM_LIBERO_CFG"):
        return None
    try:
        pkg = _libero_pkg_dir()
    except ImportError:
        return None
    cfg_dir = cache_root() / "libero-config"
    _write_if_changed(cfg_dir / "config.yaml", "".join(
        f"{k}: {json.dumps(str(v))}\n" for k, v in (
            ("benchmark_root", pkg), ("bddl_files", pkg / "bddl_files"),
            ("init_states", pkg / "init_files"), ("datasets", pkg.parent / "datasets"),
            ("assets", assets or pkg / "assets"),
        )
    ))
    os.environ["LIBERO_CONFIG_PATH"] = str(cfg_dir)
    os.environ["_TANDEM_LIBERO_CFG"] = "1"  # ours: may be rewritten
    return cfg_dir


_prepared_assets: Path | None = None
_prepare_lock = threading.Lock()


def prepare_libero(assets_path: str | None = None, assets_tarball: str | None = None,
                   gl: str | None = "auto") -> Path:
    """Make ``import libero.libero`` prompt-free and offline; return the assets folder."""
    global _prepared_assets
    from envs.registry import configure_rendering

    with _prepare_lock:
        configure_rendering(gl)
        assets = resolve_assets(assets_path, assets_tarball)
        ensure_libero_config(assets)
        import libero.libero as L  # noqa: E402  (after the config exists)

        if _prepared_assets is not None and _prepared_assets != assets:
            import warnings

            warnings.warn(f"LIBERO assets switched from {_prepared_assets} to {assets} in one process",
                          stacklevel=2)
        L._assets_path_cache = str(assets)
        _prepared_assets = assets
        return assets


# ---------------------------------------------------------------- renderer set-up

_render_local = threading.local()


class _render_settings:
    """While active (on this thread), robosuite GL contexts are made with these
    ``vis.global_.offwidth/offheight`` and ``vis.quality.offsamples`` values."""

    def __init__(self, settings: dict[str, int] | None):
        self.settings = settings

    def __enter__(self):
        _install_render_hook()
        self.prev = getattr(_render_local, "settings", None)
        _render_local.settings = self.settings

    def __exit__(self, *exc):
        _render_local.settings = self.prev


def _install_render_hook() -> None:
    from robosuite.utils import binding_utils as bu

    cls = bu.MjRenderContext
    if getattr(cls, "_tandem_hook", False):
        return
    original = cls._set_mujoco_context_and_buffers

    def _set_mujoco_context_and_buffers(self):
        settings = getattr(_render_local, "settings", None)
        if settings:
            m = self.model._model
            if "offwidth" in settings:
                m.vis.global_.offwidth = int(settings["offwidth"])
                m.vis.global_.offheight = int(settings["offheight"])
            if "offsamples" in settings:
                m.vis.quality.offsamples = int(settings["offsamples"])
        original(self)

    cls._set_mujoco_context_and_buffers = _set_mujoco_context_and_buffers
    cls._tandem_hook = True


# ---------------------------------------------------------------- the env

def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis-angle (robosuite / OpenVLA-OFT convention)."""
    q = np.asarray(quat, dtype=np.float64).copy()
    q[3] = np.clip(q[3], -1.0, 1.0)
    den = np.sqrt(1.0 - q[3] * q[3])
    if np.isclose(den, 0.0):
        return np.zeros(3)
    return (q[:3] * 2.0 * np.arccos(q[3])) / den


class LiberoEnv(gym.Env):
    """One LIBERO task as a gymnasium env (see the module docstring)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    ee_pos_index = (0, 1, 2)        # end-effector position in observation.state (for SafetyWrapper)
    action_pos_index = (0, 1, 2)    # translation components of the action

    def __init__(
        self,
        suite: str = "libero_spatial",
        task_id: int | Sequence[int] | str = 0,
        *,
        init_state_id: int | None = 0,
        image_size: int | tuple[int, int] = 128,
        cameras: dict[str, str] | None = None,
        num_steps_wait: int = 10,
        fast_settle: bool = True,
        hard_reset: bool = False,
        render_quality: str = "faithful",
        max_episode_steps: int | None = None,
        assets_path: str | None = None,
        assets_tarball: str | None = None,
        gl: str | None = "auto",
        render_mode: str | None = "rgb_array",
    ):
        tasks = list_tasks(suite)
        if isinstance(task_id, str):
            if task_id != "all":
                raise ValueError(f"task_id must be an index, a list of indices or 'all', got {task_id!r}")
            ids = list(range(len(tasks)))
        elif isinstance(task_id, (int, np.integer)):
            ids = [int(task_id)]
        else:
            ids = [int(t) for t in task_id]
        bad = [t for t in ids if not 0 <= t < len(tasks)]
        if not ids or bad:
            raise ValueError(f"{suite} has tasks 0..{len(tasks) - 1}, got task_id={task_id}")
        self.suite = suite
        self.tasks = [tasks[t] for t in ids]
        self._init_states = {t.task_id: load_init_states(t.init_states_file) for t in self.tasks}
        self.task = self.tasks[0]
        self.init_states = self._init_states[self.task.task_id]
        if init_state_id is not None and not all(0 <= int(init_state_id) < len(v)
                                                 for v in self._init_states.values()):
            raise ValueError(f"init_state_id {init_state_id} is out of range for {suite} {ids}")
        self.init_state_id = None if init_state_id is None else int(init_state_id)
        self._next_cycle = 0
        self._built_task: int | None = None
        h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.image_hw = (int(h), int(w))
        self.cameras = dict(DEFAULT_CAMERAS if cameras is None else cameras)
        self.num_steps_wait = int(num_steps_wait)
        self.fast_settle = bool(fast_settle)
        self.hard_reset = bool(hard_reset)
        if render_quality not in RENDER_QUALITIES:
            raise ValueError(f"render_quality must be one of {RENDER_QUALITIES}, got {render_quality!r}")
        self.render_quality = render_quality
        self.default_max_episode_steps = int(max_episode_steps or SUITE_MAX_STEPS[suite])
        self._assets_args = (assets_path, assets_tarball, gl)
        self.render_mode = render_mode
        self._env = None
        self._last_obs: dict[str, Any] | None = None
        self._done = True
        self.current_init_state_id: int | None = None

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
            with _render_settings(self._render_settings()):
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
        if not self.cameras:
            return None
        h, w = self.image_hw
        out = {"offwidth": w, "offheight": h}
        if self.render_quality == "fast":
            out["offsamples"] = 0
        return out

    def _tune_renderer(self) -> None:
        """Scene flags of ``render_quality="fast"`` (no reflections, no shadows). The
        offscreen buffer size (the image size: same pixels, less work than LIBERO's 640x480)
        and the multisample count are applied by :func:`_install_render_hook` when
        robosuite makes its GL context, so the context is never built twice."""
        if not self.cameras or self.render_quality != "fast":
            return
        import mujoco

        ctx = getattr(self._env.sim, "_render_context_offscreen", None)
        if ctx is not None:
            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0

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

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        n_tasks = len(self.tasks)
        # episode counter k: the seed if given, else the next in turn; with several tasks,
        # task k mod T and init state (k div T) mod N
        if seed is not None:
            k = int(seed)
        else:
            k = self._next_cycle
            self._next_cycle += 1
        if options.get("task_id") is not None:
            want = int(options["task_id"])
            match = [t for t in self.tasks if t.task_id == want]
            if not match:
                raise ValueError(f"task {want} is not one of this env's tasks {[t.task_id for t in self.tasks]}")
            self.task = match[0]
        else:
            self.task = self.tasks[k % n_tasks]
        self.init_states = self._init_states[self.task.task_id]
        if options.get("init_state_id") is not None:
            idx = int(options["init_state_id"])
        elif self.init_state_id is not None:
            idx = self.init_state_id
        else:
            idx = k // n_tasks
        idx %= len(self.init_states)
        env = self._ensure_env()
        # LIBERO re-samples fixture placements (model body_pos, not part of the init state)
        # from numpy's global RNG on every reset; seed it from this env's RNG so a seeded
        # env reproduces its layouts, and leave the global RNG as it was.
        layout_seed = int(self.np_random.integers(2**31 - 1))
        saved = np.random.get_state()
        np.random.seed(layout_seed)
        try:
            with _render_settings(self._render_settings()):  # a hard reset rebuilds the context
                env.reset()
        finally:
            np.random.set_state(saved)
        self._tune_renderer()
        raw = env.set_init_state(self.init_states[idx])
        if self.num_steps_wait:
            if self.fast_settle and self.cameras:
                self._set_cameras_enabled(False)
            try:
                for _ in range(self.num_steps_wait):
                    raw, _, _, _ = env.step(DUMMY_ACTION)
            finally:
                if self.fast_settle and self.cameras:
                    self._set_cameras_enabled(True)
            if self.fast_settle and self.cameras:
                raw = env.env._get_observations(force_update=True)
        self.current_init_state_id = idx
        self._done = False
        obs = self._format(raw)
        self._last_obs = obs
        return obs, {"is_success": bool(env.check_success()), "init_state_id": idx,
                     "task_id": self.task.task_id, "suite": self.suite}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset()")
        a = np.asarray(action, dtype=np.float64).reshape(ACTION_DIM)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"non-finite action {a}")
        a = np.clip(a, -1.0, 1.0)
        raw, _, _, info = self._env.step(a)
        success = bool(self._env.check_success())
        obs = self._format(raw)
        self._last_obs = obs
        self._done = success
        info = dict(info or {})
        info.update(is_success=success, init_state_id=self.current_init_state_id)
        return obs, float(success), success, False, info

    def check_success(self) -> bool:
        return bool(self._ensure_env().check_success())

    def observe(self) -> dict[str, Any]:
        """Re-read the observation after the sim state was changed directly (tests, tools)."""
        raw = self._env.env._get_observations(force_update=True)
        self._last_obs = self._format(raw)
        return self._last_obs

    def render(self):
        if self._last_obs is None:
            return None
        imgs = [v for k, v in self._last_obs.items() if k.startswith(OBS_IMAGE_PREFIX)]
        return np.concatenate(imgs, axis=1) if imgs else None

    def close(self):
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env = None


def _joints_of(inner, name: str) -> list[str]:
    if name in inner.object_sites_dict:
        return list(inner.object_sites_dict[name].joints)
    return list(inner.get_object(name).joints)


def _target_pos(inner, name: str) -> np.ndarray:
    state = inner.object_states_dict[name]
    if state.object_state_type == "site":
        return np.array(inner.sim.data.get_site_xpos(name))
    return np.array(inner.sim.data.body_xpos[inner.obj_body_id[name]])


def force_goal_state(env: LiberoEnv, settle_steps: int = 15, lift: float = 0.04) -> bool:
    """Put the scene into a state that satisfies the task's goal, for tests and tools.

    Articulated goals (``Open``, ``Close``, ``Turnon``, ``Turnoff``) set the joint to a value
    in its range for which LIBERO's predicate holds; ``On``/``In`` goals teleport the object
    ``lift`` metres above the target (an object or a region site) and let it drop for
    ``settle_steps`` no-op control steps. Returns ``check_success()``; the env's last
    observation is refreshed. Not a physically achieved success: it only exercises the
    success predicates and everything downstream of them.
    """
    from libero.libero.envs.predicates import eval_predicate_fn

    inner = env._ensure_env().env
    sim = inner.sim
    goal = inner.parsed_problem["goal_state"]
    unary = [g for g in goal if len(g) == 2]
    binary = [g for g in goal if len(g) == 3]
    for pred, name in unary:
        joints = _joints_of(inner, name)
        state = inner.object_states_dict[name]
        for jname in joints:
            jid = sim.model.joint_name2id(jname)
            lo, hi = sim.model.jnt_range[jid]
            if lo >= hi:
                lo, hi = -np.pi, np.pi
            for v in np.linspace(lo, hi, 41):
                sim.data.set_joint_qpos(jname, v)
                sim.forward()
                if eval_predicate_fn(pred.lower(), state):
                    break
    for k, (_pred, obj, target) in enumerate(binary):
        pos = _target_pos(inner, target)
        body = inner.get_object(obj)
        jname = body.joints[-1]
        qpos = np.array(sim.data.get_joint_qpos(jname))
        # several objects into one container: spread them a little
        offset = np.array([0.03 * ((k % 3) - 1), 0.03 * ((k // 3) - 0), 0.0]) if len(binary) > 1 else 0.0
        qpos[:3] = pos + np.array([0.0, 0.0, lift]) + offset
        sim.data.set_joint_qpos(jname, qpos)
        sim.data.set_joint_qvel(jname, np.zeros(6))
        sim.forward()
    for _ in range(settle_steps if binary else 0):
        env._env.step(DUMMY_ACTION)
    env.observe()
    return env.check_success()


def make_libero_env(cfg: dict) -> LiberoEnv:
    """Factory for :mod:`envs.registry` (``name``: a suite or ``libero`` with ``suite``)."""
    suite = cfg.get("suite") or cfg.get("name")
    size = cfg.get("render_size") or cfg.get("image_size") or 128
    if isinstance(size, list):
        size = tuple(size)
    task_id = cfg.get("task_id", 0)
    return LiberoEnv(
        suite, task_id if isinstance(task_id, (str, list, tuple)) else int(task_id),
        init_state_id=cfg.get("init_state_id", 0),
        image_size=size,
        cameras=cfg.get("cameras"),
        num_steps_wait=int(cfg.get("num_steps_wait", 10)),
        fast_settle=bool(cfg.get("fast_settle", True)),
        hard_reset=bool(cfg.get("hard_reset", False)),
        render_quality=str(cfg.get("render_quality", "faithful")),
        max_episode_steps=cfg.get("suite_max_steps"),
        assets_path=cfg.get("assets_path"),
        assets_tarball=cfg.get("assets_tarball"),
        gl=cfg.get("gl", "auto"),
    )


ensure_libero_config()


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


if __name__ == "__main__":
    _bench()
