"""``point_reach``: a cheap, pure-numpy image task with language instructions and a 0/1
outcome, for CPU learning proofs of VLA-style policies (images + instruction + state).

A point agent moves in the unit square [0, 1]^2 (x right, y up). There are ``num_tasks``
tasks (default 4, at most 8); task ``t`` is a coloured target disk described by the
instruction ``"reach the <colour> target"`` (red, green, blue, yellow, cyan, magenta,
orange, brown). Reaching it -- the agent centre within ``success_radius`` of the target
centre -- *terminates* the episode with reward 1 (``info["is_success"]`` True); otherwise the
reward is 0 (``dense_reward: true``: minus the distance to the target). The time limit
(``max_episode_steps``, default 30, exposed as ``default_max_episode_steps``) is applied by
:func:`envs.registry.make_env` as a truncation: the two are never merged.

Layout (Tandem schema, :mod:`data.core.schema`):

* ``observation.state`` float32 [2] -- the agent's (x, y); with ``state_has_target: true``
  also the target's (x, y) (so [4]; for state-only runs). By default the target is *not* in
  the state: the policy must read it from the image and the instruction.
* ``observation.images.<name>`` uint8 [H, W, 3] per camera (default one, ``image``, 32x32).
  A camera's view is ``top`` (the whole square; targets as disks of radius
  ``success_radius``, the agent as a white disk) or ``wrist`` (an agent-centred window
  ``wrist_fov`` wide; grey outside the square).
* ``task`` -- the instruction.
* action float32 Box [-1, 1]^A (A = ``action_dim`` >= 2; dims past the first two are
  ignored padding): the velocity, times ``max_speed`` per step; the agent stays in the square.

How much the instruction matters: with ``distractors: true`` (default) the targets of *all*
tasks are drawn, so the image alone does not say which one to reach -- the instruction
does. With ``randomize_targets: true`` the target positions are drawn anew every episode
(else each task's target sits at a fixed place on a circle around the centre), so the
policy needs the image too. The hardest setting is both. ``start_distance`` keeps the start
that far from every target (default ``2 * success_radius``; with ``randomize_targets`` the
start is drawn first and the targets around it), so with ``max_speed`` it bounds the fewest
steps an episode can take. ``config/env/point_reach_vl.yaml`` (``env=point_reach_vl``) is that
setting with two tasks and the target out of the state: only the instruction says which
drawn target is right, only the image where it is, and reaching takes at least 8 steps.
``target_slots: K`` (K >= ``num_tasks``) puts the targets on K fixed places on that circle
instead, each task's target on a different random one every episode: the layout still changes
per episode (which colour sits where), with less for a small CNN to learn than free positions.

Tasks and initial states (:mod:`envs.reset_options`): config ``task_id`` is one task index,
a list of them or ``"all"`` (default); a reset without ``options["task_id"]`` picks one of
them uniformly from the env's RNG (reproducible with ``reset(seed=...)``). ``options=
{"task_id": t, "init_state": i}``: ``t`` must be one of the configured tasks (else
``ValueError``); ``i`` (any int >= 0) fixes the start position (and, with
``randomize_targets``, the target layout; without ``task_id`` also the task) from an RNG
seeded by :func:`envs.reset_options.init_state_seed`, whatever the seed, leaving the env's
own RNG stream untouched. ``info`` reports ``task_id``, ``init_state`` (None without one),
``is_success`` and ``distance``.

:meth:`PointReachEnv.expert_action` (or :func:`expert_action` on a wrapped env) is the
scripted demonstrator: the straight-line velocity toward the target, never overshooting; it
succeeds in every episode. Uniform-random actions succeed in ~15% of episodes (12% with 8
tasks): enough for sparse-reward RL to start, far from solved. Speed (one loaded CPU core,
through make_env): ~30k steps/s with the default 32x32 top camera, ~10k with top + wrist
cameras. ``python -m envs.point_reach`` prints the rates and the speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.spec import EnvSpec
from envs.reset_options import check_reset_options, init_state_seed
from envs.wrappers.remap import TEXT_SPACE

ENV_NAME = "point_reach"
#: (colour name, RGB) of task t's target, in task order
PALETTE: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (230, 40, 40)), ("green", (40, 200, 60)), ("blue", (50, 90, 245)),
    ("yellow", (240, 220, 40)), ("cyan", (40, 220, 230)), ("magenta", (220, 50, 220)),
    ("orange", (250, 140, 20)), ("brown", (140, 90, 40)),
)
MAX_TASKS = len(PALETTE)
AGENT_COLOR = (255, 255, 255)
BACKGROUND = (24, 24, 24)
OUTSIDE = (96, 96, 96)          # beyond the square (wrist view)
VIEWS = ("top", "wrist")
DEFAULTS: dict[str, Any] = {
    "num_tasks": 4, "task_id": "all", "image_size": 32, "render_size": None,
    "cameras": {"image": "top"}, "state_has_target": False, "action_dim": 2,
    "max_speed": 0.1, "success_radius": 0.08, "agent_radius": 0.04, "dense_reward": False,
    "distractors": True, "randomize_targets": False, "wrist_fov": 0.5, "max_episode_steps": 30,
    "start_distance": None, "target_slots": 0,
}
FIXED_LAYOUT_RADIUS = 0.3       # fixed targets: on this circle around (0.5, 0.5)
_MARGIN = 0.1                   # random targets keep this far from the square's edge


def instruction(task_id: int) -> str:
    return f"reach the {PALETTE[task_id][0]} target"


@dataclass(frozen=True)
class PointReachConfig:
    """The parsed, checked config (shared by the env and :func:`point_reach_spec`)."""

    num_tasks: int
    task_ids: tuple[int, ...]
    image_hw: tuple[int, int]
    cameras: dict[str, str]         # observation.images.<name> -> view
    state_has_target: bool
    action_dim: int
    max_speed: float
    success_radius: float
    agent_radius: float
    dense_reward: bool
    distractors: bool
    randomize_targets: bool
    wrist_fov: float
    max_episode_steps: int
    #: the start's least distance to every target (None: 2 * success_radius)
    start_distance: float | None = None
    #: > 0: the targets sit on this many fixed slots, a random one each per episode
    target_slots: int = 0

    @property
    def state_dim(self) -> int:
        return 4 if self.state_has_target else 2

    @classmethod
    def parse(cls, cfg: Mapping[str, Any] | None = None) -> "PointReachConfig":
        c = {**DEFAULTS, **{k: v for k, v in dict(cfg or {}).items() if v is not None}}
        n = int(c["num_tasks"])
        if not 1 <= n <= MAX_TASKS:
            raise ValueError(f"{ENV_NAME}: num_tasks must be 1..{MAX_TASKS}, got {n}")
        size = c["render_size"] or c["image_size"]
        if isinstance(size, (int, np.integer)):
            size = (size, size)
        hw = tuple(int(s) for s in size)
        if len(hw) != 2 or min(hw) < 4:
            raise ValueError(f"{ENV_NAME}: image size must be an int or [H, W] >= 4, got {size!r}")
        positive = {k: float(c[k])
                    for k in ("max_speed", "success_radius", "agent_radius", "wrist_fov")}
        bad = [k for k, v in positive.items() if not v > 0]
        if bad:
            raise ValueError(f"{ENV_NAME}: {', '.join(bad)} must be > 0")
        a = int(c["action_dim"])
        if a < 2:
            raise ValueError(f"{ENV_NAME}: action_dim must be >= 2 (x, y velocity), got {a}")
        steps = int(c["max_episode_steps"] or DEFAULTS["max_episode_steps"])
        start = c["start_distance"]
        if start is not None and not 0 < float(start) <= 0.6:
            raise ValueError(f"{ENV_NAME}: start_distance must be in (0, 0.6] or null, got {start!r}")
        slots = int(c["target_slots"] or 0)
        if slots and not n <= slots <= MAX_TASKS:
            raise ValueError(f"{ENV_NAME}: target_slots must be 0 or num_tasks..{MAX_TASKS}, got {slots}")
        if slots and c["randomize_targets"]:
            raise ValueError(f"{ENV_NAME}: target_slots and randomize_targets exclude each other")
        return cls(num_tasks=n, target_slots=slots, task_ids=_task_ids(c["task_id"], n), image_hw=hw,
                   cameras=_cameras(c["cameras"]), state_has_target=bool(c["state_has_target"]),
                   action_dim=a, dense_reward=bool(c["dense_reward"]),
                   distractors=bool(c["distractors"]),
                   randomize_targets=bool(c["randomize_targets"]), max_episode_steps=steps,
                   start_distance=None if start is None else float(start), **positive)


def _task_ids(task_id: Any, n: int) -> tuple[int, ...]:
    if isinstance(task_id, str):
        if task_id != "all":
            raise ValueError(f"{ENV_NAME}: task_id must be an index, a list or 'all', "
                             f"got {task_id!r}")
        return tuple(range(n))
    ids = [int(task_id)] if isinstance(task_id, (int, np.integer)) else [int(t) for t in task_id]
    bad = [t for t in ids if not 0 <= t < n]
    if not ids or bad or len(set(ids)) != len(ids):
        raise ValueError(f"{ENV_NAME}: has tasks 0..{n - 1} (num_tasks), got task_id={task_id!r}")
    return tuple(ids)


def _cameras(cameras: Any) -> dict[str, str]:
    """``{name: view}``; a list names views (``image`` meaning ``top``)."""
    if isinstance(cameras, Mapping):
        cams = {str(k): str(v) for k, v in cameras.items()}
    else:
        cams = {str(k): ("top" if str(k) == "image" else str(k)) for k in cameras}
    bad = {k: v for k, v in cams.items() if v not in VIEWS}
    if bad:
        raise ValueError(f"{ENV_NAME}: camera views are {VIEWS}, got {bad}")
    return cams


def point_reach_spec(cfg: Mapping[str, Any] | None = None) -> EnvSpec:
    """The layout :func:`point_reach_from_config` gives for ``cfg`` (before the registry's
    wrappers), without building the env."""
    c = PointReachConfig.parse(cfg)
    return EnvSpec(state_dim=c.state_dim, action_dim=c.action_dim,
                   cameras={name: (*c.image_hw, 3) for name in c.cameras}, has_task=True,
                   max_episode_steps=c.max_episode_steps)


def _spread(rng: np.random.Generator, n: int, min_dist: float, avoid: np.ndarray,
            low: float, high: float, tries: int = 64, avoid_dist: float | None = None) -> np.ndarray:
    """``n`` points in [low, high]^2, each at least ``avoid_dist`` (default ``min_dist``) from
    ``avoid`` and ``min_dist`` from the ones before it (the candidate of ``tries`` that falls
    least short where none qualifies)."""
    avoid = [np.asarray(p, np.float64) for p in avoid]
    far = min_dist if avoid_dist is None else avoid_dist
    out: list[np.ndarray] = []
    for _ in range(n):
        cand = rng.uniform(low, high, size=(tries, 2))
        if avoid or out:
            short = np.zeros(tries)
            for pts, need in ((avoid, far), (out, min_dist)):
                if pts:
                    d = np.linalg.norm(cand[:, None, :] - np.asarray(pts)[None], axis=-1).min(axis=1)
                    short = np.maximum(short, need - d)
            ok = np.flatnonzero(short <= 0)
            p = cand[ok[0]] if ok.size else cand[int(np.argmin(short))]
        else:
            p = cand[0]
        out.append(p)
    return np.asarray(out, np.float64).reshape(n, 2)


class PointReachEnv(gym.Env):
    """See the module docstring. ``cfg`` keys: ``config/env/point_reach.yaml``."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, cfg: Mapping[str, Any] | None = None, *,
                 render_mode: str | None = "rgb_array"):
        self.cfg = c = PointReachConfig.parse(cfg)
        self.default_max_episode_steps = c.max_episode_steps
        self.render_mode = render_mode
        self.instructions = [instruction(t) for t in range(c.num_tasks)]
        self._colors = np.array([rgb for _, rgb in PALETTE[:c.num_tasks]], np.uint8)
        obs_spaces: dict[str, spaces.Space] = {
            OBS_STATE: spaces.Box(-np.inf, np.inf, (c.state_dim,), np.float32)}
        for name in c.cameras:
            obs_spaces[OBS_IMAGE_PREFIX + name] = spaces.Box(0, 255, (*c.image_hw, 3), np.uint8)
        obs_spaces[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (c.action_dim,), np.float32)
        self.spec = gym.envs.registration.EnvSpec(id="tandem/PointReach-v0",
                                                  entry_point="envs.point_reach:PointReachEnv")
        h, w = c.image_hw
        self._u = (np.arange(w) + 0.5) / w          # pixel-centre fractions, left to right
        self._v = 1.0 - (np.arange(h) + 0.5) / h    # bottom-up: row 0 is the top
        ang = 2 * np.pi * np.arange(c.target_slots or c.num_tasks) / (c.target_slots or c.num_tasks)
        circle = 0.5 + FIXED_LAYOUT_RADIUS * np.stack([np.cos(ang), np.sin(ang)], 1)
        self._slots = circle if c.target_slots else None
        self._fixed_targets = circle[:c.num_tasks]
        self.targets = self._fixed_targets.copy()
        self.pos = np.full(2, 0.5)
        self.task_id = c.task_ids[0]
        self.init_state: int | None = None
        self._top_layer: np.ndarray | None = None
        self._done = True
        self._last_obs: dict[str, Any] | None = None

    # ------------------------------------------------------------------ episode

    @property
    def target(self) -> np.ndarray:
        """The current task's target (x, y)."""
        return self.targets[self.task_id]

    @property
    def instruction(self) -> str:
        return self.instructions[self.task_id]

    def distance(self) -> float:
        dx, dy = self.pos - self.target
        return math.hypot(float(dx), float(dy))

    def _pick_task(self, want: int | None, rng: np.random.Generator) -> int:
        ids = self.cfg.task_ids
        if want is None:
            return ids[int(rng.integers(len(ids)))] if len(ids) > 1 else ids[0]
        if want >= self.cfg.num_tasks:
            raise ValueError(f"{ENV_NAME}: task_id {want} is out of range: tasks are "
                             f"0..{self.cfg.num_tasks - 1}")
        if want not in ids:
            raise ValueError(f"{ENV_NAME}: task_id {want} is not one of this env's tasks "
                             f"{list(ids)}; configure task_id: all (or a list holding it)")
        return want

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """``options``: a learner's job, ``task_id`` and ``init_state`` (module docstring)."""
        opts = check_reset_options(options, ENV_NAME)
        super().reset(seed=seed)
        init_state = opts["init_state"]
        rng = (self.np_random if init_state is None
               else np.random.default_rng(init_state_seed(init_state)))
        task = self._pick_task(opts["task_id"], rng)   # raises before anything changes
        c = self.cfg
        if c.randomize_targets and c.start_distance is not None:
            # the start first, then every target at least start_distance from it
            self.pos = rng.uniform(0.05, 0.95, size=2)
            self.targets = _spread(rng, c.num_tasks, 3.0 * c.success_radius, self.pos[None],
                                   _MARGIN, 1.0 - _MARGIN, tries=256, avoid_dist=c.start_distance)
        else:
            if self._slots is not None:
                self.targets = self._slots[rng.permutation(len(self._slots))[:c.num_tasks]]
            elif c.randomize_targets:
                self.targets = _spread(rng, c.num_tasks, 3.0 * c.success_radius, np.empty((0, 2)),
                                       _MARGIN, 1.0 - _MARGIN)
            else:
                self.targets = self._fixed_targets.copy()
            # the start keeps away from every target, so it does not depend on the task
            far = 2.0 * c.success_radius if c.start_distance is None else c.start_distance
            self.pos = _spread(rng, 1, far, self.targets, 0.05, 0.95)[0]
        self.task_id, self.init_state = task, init_state
        self._top_layer = None
        self._done = False
        dist = self.distance()
        self._last_obs = self._obs()
        return self._last_obs, {"is_success": bool(dist <= c.success_radius), "distance": dist,
                                "task_id": task, "init_state": init_state}

    def step(self, action):
        if self._done:
            raise RuntimeError(f"{ENV_NAME}: step() after the episode ended; call reset()")
        c = self.cfg
        a = np.asarray(action, dtype=np.float64).reshape(c.action_dim)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{ENV_NAME}: non-finite action {a}")
        self.pos = np.clip(self.pos + np.clip(a[:2], -1.0, 1.0) * c.max_speed, 0.0, 1.0)
        dist = self.distance()
        success = dist <= c.success_radius
        reward = 1.0 if success else (-dist if c.dense_reward else 0.0)
        self._done = success
        self._last_obs = self._obs()
        info = {"is_success": bool(success), "distance": dist, "task_id": self.task_id,
                "init_state": self.init_state}
        return self._last_obs, float(reward), bool(success), False, info

    def expert_action(self, obs: Mapping[str, Any] | None = None, *, noise: float = 0.0,
                      rng: np.random.Generator | None = None) -> np.ndarray:
        """The scripted demonstrator: the straight-line velocity toward this episode's
        target, scaled not to overshoot (norm <= 1), zero padding to ``action_dim``.
        ``obs`` (optional): take the agent position from this observation's state instead
        of the env's. ``noise``: add N(0, noise^2) per dimension (from ``rng``, else the
        env's RNG), then clip."""
        pos = self.pos if obs is None else np.asarray(obs[OBS_STATE], np.float64)[:2]
        delta = (self.target - pos) / self.cfg.max_speed
        norm = float(np.linalg.norm(delta))
        if norm > 1.0:
            delta = delta / norm
        a = np.zeros(self.cfg.action_dim, np.float64)
        a[:2] = delta
        if noise:
            a[:2] += (rng or self.np_random).normal(0.0, noise, 2)
        return np.clip(a, -1.0, 1.0).astype(np.float32)

    # ------------------------------------------------------------------ rendering

    def _obs(self) -> dict[str, Any]:
        state = np.concatenate([self.pos, self.target]) if self.cfg.state_has_target else self.pos
        obs: dict[str, Any] = {OBS_STATE: state.astype(np.float32)}
        for name, view in self.cfg.cameras.items():
            img = self._render_top() if view == "top" else self._render_wrist()
            obs[OBS_IMAGE_PREFIX + name] = img
        obs[TASK] = self.instruction
        return obs

    def _drawn_targets(self) -> list[int]:
        return list(range(self.cfg.num_tasks)) if self.cfg.distractors else [self.task_id]

    def _render_top(self) -> np.ndarray:
        if self._top_layer is None:   # the targets do not move within an episode
            layer = np.empty((*self.cfg.image_hw, 3), np.uint8)
            layer[:] = BACKGROUND
            for t in self._drawn_targets():
                self._disk(layer, 0.0, 0.0, 1.0, self.targets[t], self.cfg.success_radius,
                           self._colors[t])
            self._top_layer = layer
        img = self._top_layer.copy()
        self._disk(img, 0.0, 0.0, 1.0, self.pos, self.cfg.agent_radius, AGENT_COLOR)
        return img

    def _render_wrist(self) -> np.ndarray:
        fov = self.cfg.wrist_fov
        x0, y0 = float(self.pos[0]) - fov / 2, float(self.pos[1]) - fov / 2
        img = np.empty((*self.cfg.image_hw, 3), np.uint8)
        img[:] = OUTSIDE
        xs, ys = x0 + fov * self._u, y0 + fov * self._v
        cols, rows = np.flatnonzero((xs >= 0) & (xs <= 1)), np.flatnonzero((ys >= 0) & (ys <= 1))
        if cols.size and rows.size:
            img[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = BACKGROUND
        for t in self._drawn_targets():
            self._disk(img, x0, y0, fov, self.targets[t], self.cfg.success_radius, self._colors[t])
        self._disk(img, x0, y0, fov, self.pos, self.cfg.agent_radius, AGENT_COLOR)
        return img

    def _disk(self, img: np.ndarray, x0: float, y0: float, fov: float, centre: np.ndarray,
              radius: float, color) -> None:
        """Fill the pixels whose centres lie within ``radius`` of ``centre`` (world units)
        in a view of the square [x0, x0 + fov] x [y0, y0 + fov]; at least the nearest pixel."""
        h, w = self.cfg.image_hw
        cu, cv = (float(centre[0]) - x0) / fov, (float(centre[1]) - y0) / fov   # view fractions
        r = radius / fov
        j0, j1 = max(math.floor((cu - r) * w), 0), min(math.ceil((cu + r) * w), w)
        i0, i1 = max(math.floor((1.0 - cv - r) * h), 0), min(math.ceil((1.0 - cv + r) * h), h)
        if j0 >= j1 or i0 >= i1:
            return
        du = self._u[j0:j1] - cu
        dv = self._v[i0:i1] - cv
        d2 = dv[:, None] ** 2 + du[None, :] ** 2
        mask = d2 <= r * r
        if not mask.any():   # smaller than a pixel: the nearest one
            mask[np.unravel_index(int(np.argmin(d2)), mask.shape)] = True
        img[i0:i1, j0:j1][mask] = color

    def render(self):
        if self._last_obs is None:
            return None
        imgs = [v for k, v in self._last_obs.items() if k.startswith(OBS_IMAGE_PREFIX)]
        return np.concatenate(imgs, axis=1) if imgs else None


def point_reach_from_config(cfg: Mapping[str, Any] | None = None) -> PointReachEnv:
    """Factory for :mod:`envs.registry` (``config/env/point_reach.yaml``)."""
    return PointReachEnv(cfg)


def expert_action(env_or_obs: Any, env: gym.Env | None = None, **kw) -> np.ndarray:
    """:meth:`PointReachEnv.expert_action` through any wrappers: ``expert_action(env)``, or
    ``expert_action(obs, env)`` for the agent position in ``obs``."""
    if isinstance(env_or_obs, gym.Env):
        return env_or_obs.unwrapped.expert_action(**kw)
    if env is None:
        raise TypeError("expert_action(obs, env): the env holds the target")
    return env.unwrapped.expert_action(env_or_obs, **kw)


def rates(cfg: Mapping[str, Any] | None = None, episodes: int = 200, *, policy: str = "expert",
          seed: int = 0) -> float:
    """Success rate of ``policy`` (``expert`` or ``random``) over ``episodes`` episodes of
    the env :func:`envs.registry.make_env` builds from ``{"name": "point_reach", **cfg}``."""
    from envs.registry import make_env

    env = make_env({"name": ENV_NAME, **dict(cfg or {})})
    env.action_space.seed(seed)
    wins = 0
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        while True:
            a = expert_action(env) if policy == "expert" else env.action_space.sample()
            _, _, term, trunc, info = env.step(a)
            if term or trunc:
                wins += bool(info["is_success"])
                break
    env.close()
    return wins / episodes


def _main(argv: Sequence[str] | None = None) -> None:
    """``python -m envs.point_reach``: success rates (expert, random) and steps/s."""
    import time

    from envs.registry import make_env

    for cfg in ({}, {"randomize_targets": True, "cameras": ["image", "wrist"]}):
        exp, rnd = rates(cfg, 200), rates(cfg, 1000, policy="random")
        env = make_env({"name": ENV_NAME, **cfg})
        env.reset(seed=0)
        acts = np.random.default_rng(0).uniform(-1, 1, (5000, env.action_space.shape[0]))
        n, t0 = len(acts), time.perf_counter()
        for act in acts.astype(np.float32):
            _, _, term, trunc, _ = env.step(act)
            if term or trunc:
                env.reset()
        sps = n / (time.perf_counter() - t0)
        print(f"point_reach {cfg}: expert {exp:.3f}, random {rnd:.3f}, {sps:.0f} steps/s")


if __name__ == "__main__":
    _main()
