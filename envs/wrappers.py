"""Gymnasium wrappers shared by every Tandem env.

All of them keep ``terminated`` (the task ended: success, failure, a safety stop) and
``truncated`` (a time limit or an outside interruption) apart, and work on the common
observation dict of :mod:`data.core.schema`.

* :class:`ImageTransform`      crop and/or resize every ``observation.images.*`` entry
* :class:`ObsRemap`            map a foreign observation dict onto the common schema
* :class:`SuccessReward`       0/1 reward from ``info["is_success"]``; terminate on success
* :class:`TimeLimit`           truncate after N steps; exposes ``spec.max_episode_steps``
* :class:`SafetyWrapper`       clip actions, zero translations that leave the workspace,
                               refuse non-finite actions
* :class:`ActionChunkWrapper`  execute the first k of an [H, A] action chunk in one call
* :class:`EpisodeRecorder`     write each episode as a ``.npz`` (transition layout)
* :class:`RewardClassifierReward`  reward from a trained image classifier (see
                               ``tools/train_reward_classifier.py``)
"""

from __future__ import annotations

import json
import os
import string
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, STEP_ARRAYS, TASK

TEXT_SPACE = spaces.Text(max_length=512, charset=string.printable)  # the "task" entry

__all__ = [
    "ImageTransform", "ObsRemap", "SuccessReward", "TimeLimit", "SafetyWrapper",
    "ActionChunkWrapper", "EpisodeRecorder", "RewardClassifierReward", "has_time_limit",
    "resize_image", "crop_image",
]


# ---------------------------------------------------------------- images

def _hw(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


def crop_image(img: np.ndarray, crop: Sequence[float]) -> np.ndarray:
    """``crop = [top, left, height, width]`` in pixels (ints) or fractions of the image
    (floats <= 1), e.g. ``[0.05, 0.05, 0.9, 0.9]`` is a 90% centre crop."""
    h, w = img.shape[:2]
    top, left, ch, cw = crop
    if all(isinstance(v, float) and 0 <= v <= 1 for v in crop):
        top, left, ch, cw = round(top * h), round(left * w), round(ch * h), round(cw * w)
    top, left, ch, cw = int(top), int(left), int(ch), int(cw)
    if not (0 <= top < h and 0 <= left < w and ch > 0 and cw > 0 and top + ch <= h and left + cw <= w):
        raise ValueError(f"crop {crop} does not fit an image of {h}x{w}")
    return img[top:top + ch, left:left + cw]


def resize_image(img: np.ndarray, size: int | Sequence[int]) -> np.ndarray:
    """uint8 HWC resize: area averaging when shrinking, bilinear when growing."""
    h, w = _hw(size)
    if img.shape[:2] == (h, w):
        return img
    import cv2

    shrink = h < img.shape[0] or w < img.shape[1]
    out = cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    return out.reshape(h, w, -1) if img.ndim == 3 else out


class ImageTransform(gym.ObservationWrapper):
    """Crop, then resize, every camera image. ``crop`` is one crop for all cameras or a
    ``{camera: crop}`` dict (cameras without an entry are not cropped)."""

    def __init__(self, env: gym.Env, size: int | Sequence[int] | None = None,
                 crop: Sequence[float] | Mapping[str, Sequence[float]] | None = None):
        super().__init__(env)
        self.size = None if size is None else _hw(size)
        self.crop = crop
        new = dict(env.observation_space.spaces)
        for key, sp in env.observation_space.spaces.items():
            if key.startswith(OBS_IMAGE_PREFIX):
                dummy = np.zeros(sp.shape, np.uint8)
                out = self._transform(key, dummy)
                new[key] = spaces.Box(0, 255, out.shape, np.uint8)
        self.observation_space = spaces.Dict(new)

    def _crop_for(self, key: str):
        if self.crop is None:
            return None
        if isinstance(self.crop, Mapping):
            return self.crop.get(key[len(OBS_IMAGE_PREFIX):])
        return self.crop

    def _transform(self, key: str, img: np.ndarray) -> np.ndarray:
        c = self._crop_for(key)
        if c is not None:
            img = crop_image(img, c)
        if self.size is not None:
            img = resize_image(img, self.size)
        return np.ascontiguousarray(img)

    def observation(self, obs):
        return {k: self._transform(k, v) if k.startswith(OBS_IMAGE_PREFIX) else v for k, v in obs.items()}


# ---------------------------------------------------------------- schema remap

def _get_path(obs: Mapping, path: str):
    """``"pixels/front"`` or ``"pixels.front"`` looks up nested dicts (exact keys first)."""
    if path in obs:
        return obs[path]
    cur: Any = obs
    for part in path.replace("/", ".").split("."):
        cur = cur[part]
    return cur


class ObsRemap(gym.ObservationWrapper):
    """Map an env's own observation dict onto the common schema.

    ``state``: list of source paths concatenated (as float32) into ``observation.state``;
    ``images``: ``{camera_name: source_path}``; ``task``: a fixed instruction, or
    ``task_key`` a source path holding it. Paths may be nested: ``"pixels/front"``.
    """

    def __init__(self, env: gym.Env, *, state: Sequence[str], images: Mapping[str, str] | None = None,
                 task: str | None = None, task_key: str | None = None):
        super().__init__(env)
        self.state_paths = list(state)
        self.image_paths = dict(images or {})
        self.task = task
        self.task_key = task_key
        src = env.observation_space
        dim = 0
        for p in self.state_paths:
            dim += int(np.prod(_space_at(src, p).shape))
        new: dict[str, spaces.Space] = {OBS_STATE: spaces.Box(-np.inf, np.inf, (dim,), np.float32)}
        for cam, p in self.image_paths.items():
            sp = _space_at(src, p)
            new[OBS_IMAGE_PREFIX + cam] = spaces.Box(0, 255, tuple(sp.shape), np.uint8)
        if task is not None or task_key is not None:
            new[TASK] = TEXT_SPACE
        self.observation_space = spaces.Dict(new)

    def observation(self, obs):
        out: dict[str, Any] = {
            OBS_STATE: np.concatenate(
                [np.asarray(_get_path(obs, p), dtype=np.float32).reshape(-1) for p in self.state_paths]
            ) if self.state_paths else np.zeros(0, np.float32)
        }
        for cam, p in self.image_paths.items():
            out[OBS_IMAGE_PREFIX + cam] = np.ascontiguousarray(np.asarray(_get_path(obs, p), dtype=np.uint8))
        if self.task_key is not None:
            out[TASK] = str(_get_path(obs, self.task_key))
        elif self.task is not None:
            out[TASK] = self.task
        return out


def _space_at(space: spaces.Space, path: str) -> spaces.Space:
    if isinstance(space, spaces.Dict) and path in space.spaces:
        return space.spaces[path]
    cur = space
    for part in path.replace("/", ".").split("."):
        cur = cur.spaces[part]  # type: ignore[attr-defined]
    return cur


# ---------------------------------------------------------------- reward / termination

class SuccessReward(gym.Wrapper):
    """Reward 1.0 when ``info[key]`` is true, else 0.0; terminate on success if asked.

    ``info[key]`` comes from the env (LIBERO, gym-hil), a classifier, or a human label
    (:mod:`envs.intervention`)."""

    def __init__(self, env: gym.Env, key: str = "is_success", terminate: bool = True):
        super().__init__(env)
        self.key = key
        self.terminate_on_success = terminate

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        success = bool(info.get(self.key, False))
        info["is_success"] = success
        if success and self.terminate_on_success:
            terminated = True
        return obs, float(success), bool(terminated), bool(truncated), info


class TimeLimit(gym.Wrapper):
    """Truncate after ``max_episode_steps`` steps. A step that terminates is never also
    marked truncated; ``info["TimeLimit.truncated"]`` says when the limit cut it."""

    def __init__(self, env: gym.Env, max_episode_steps: int):
        super().__init__(env)
        if max_episode_steps <= 0:
            raise ValueError("max_episode_steps must be positive")
        self.max_episode_steps = int(max_episode_steps)
        self.elapsed_steps = 0

    @property
    def spec(self):
        base = self.env.spec
        if base is None:
            base = gym.envs.registration.EnvSpec(id="tandem/unnamed-v0", entry_point=None)
        from dataclasses import replace

        return replace(base, max_episode_steps=self.max_episode_steps)

    def reset(self, **kwargs):
        self.elapsed_steps = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.elapsed_steps += 1
        if self.elapsed_steps >= self.max_episode_steps and not terminated:
            truncated = True
            info["TimeLimit.truncated"] = True
        return obs, reward, terminated, truncated, info


def has_time_limit(env: gym.Env) -> bool:
    e = env
    while isinstance(e, gym.Wrapper):
        if isinstance(e, (TimeLimit, gym.wrappers.TimeLimit)):
            return True
        e = e.env
    return False


# ---------------------------------------------------------------- safety

class SafetyWrapper(gym.ActionWrapper):
    """Actor-side action safety.

    * non-finite actions are replaced by ``safe_action`` (zeros by default) and flagged;
    * actions are clipped to the action space (``clip: true``);
    * with ``workspace_low``/``workspace_high`` (metres, same frame as the end-effector
      position in ``observation.state[ee_pos_index]``), each translation component of the
      action (``action_pos_index``) that would push the end effector further beyond a bound
      is zeroed. The env's own ``ee_pos_index`` / ``action_pos_index`` attributes are used
      when present.

    Sets ``info["safety"]`` to a dict of what it did in that step and
    ``info["applied_action"]`` to the action the env received.
    """

    def __init__(self, env: gym.Env, *, clip: bool = True,
                 workspace_low: Sequence[float] | None = None,
                 workspace_high: Sequence[float] | None = None,
                 ee_pos_index: Sequence[int] | None = None,
                 action_pos_index: Sequence[int] | None = None,
                 safe_action: Sequence[float] | None = None,
                 max_abs_action: float | None = None):
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, spaces.Box):
            raise TypeError("SafetyWrapper needs a Box action space")
        self.low = space.low.astype(np.float64)
        self.high = space.high.astype(np.float64)
        self.clip = bool(clip)
        self.max_abs = None if max_abs_action is None else float(max_abs_action)
        u = env.unwrapped
        self.ws_low = None if workspace_low is None else np.asarray(workspace_low, np.float64)
        self.ws_high = None if workspace_high is None else np.asarray(workspace_high, np.float64)
        self.ee_idx = list(ee_pos_index if ee_pos_index is not None else getattr(u, "ee_pos_index", range(3)))
        self.act_idx = list(action_pos_index if action_pos_index is not None
                            else getattr(u, "action_pos_index", range(3)))
        if (self.ws_low is not None or self.ws_high is not None) and len(self.ee_idx) != len(self.act_idx):
            raise ValueError("ee_pos_index and action_pos_index must have the same length")
        self.safe_action = (np.zeros(space.shape, np.float64) if safe_action is None
                            else np.asarray(safe_action, np.float64))
        self._ee: np.ndarray | None = None
        self._report: dict[str, Any] = {}

    def _remember(self, obs) -> None:
        try:
            self._ee = np.asarray(obs[OBS_STATE], np.float64)[self.ee_idx]
        except (KeyError, IndexError, TypeError):
            self._ee = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._remember(obs)
        return obs, info

    def action(self, action):
        a = np.asarray(action, dtype=np.float64).reshape(self.low.shape).copy()
        rep: dict[str, Any] = {"non_finite": False, "clipped": False, "workspace": False}
        if not np.all(np.isfinite(a)):
            a = self.safe_action.copy()
            rep["non_finite"] = True
        if self.max_abs is not None:
            b = np.clip(a, -self.max_abs, self.max_abs)
            rep["clipped"] |= bool(np.any(b != a))
            a = b
        if self.clip:
            b = np.clip(a, self.low, self.high)
            rep["clipped"] |= bool(np.any(b != a))
            a = b
        if self._ee is not None and (self.ws_low is not None or self.ws_high is not None):
            for j, (ai, pos) in enumerate(zip(self.act_idx, self._ee, strict=True)):
                if self.ws_low is not None and pos <= self.ws_low[j] and a[ai] < 0:
                    a[ai] = 0.0
                    rep["workspace"] = True
                if self.ws_high is not None and pos >= self.ws_high[j] and a[ai] > 0:
                    a[ai] = 0.0
                    rep["workspace"] = True
        self._report = rep
        return a.astype(self.env.action_space.dtype)

    def step(self, action):
        safe = self.action(action)
        obs, reward, terminated, truncated, info = self.env.step(safe)
        info["safety"] = dict(self._report)
        info["applied_action"] = safe
        self._remember(obs)
        return obs, reward, terminated, truncated, info


# ---------------------------------------------------------------- action chunks

class ActionChunkWrapper(gym.Wrapper):
    """Accept an action chunk ``[H, A]`` and execute its first ``execute`` steps (all of
    them if None), stopping early when the episode ends.

    Returns the last observation, the summed reward, the last terminated/truncated, and
    ``info["chunk"]``: a list with one dict per executed step (``obs`` before the step,
    ``action``, ``reward``, ``terminated``, ``truncated``, ``info``) so the caller can
    record every step as its own transition.
    """

    def __init__(self, env: gym.Env, chunk_size: int, execute: int | None = None):
        super().__init__(env)
        a = env.action_space
        self.chunk_size = int(chunk_size)
        self.execute = self.chunk_size if execute is None else int(execute)
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError("execute must be in 1..chunk_size")
        self.action_space = spaces.Box(
            np.broadcast_to(a.low, (self.chunk_size, *a.shape)),
            np.broadcast_to(a.high, (self.chunk_size, *a.shape)), dtype=a.dtype,
        )
        self._obs = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, chunk):
        chunk = np.asarray(chunk)
        if chunk.ndim == 1:
            chunk = chunk[None]
        steps = []
        total = 0.0
        obs, terminated, truncated, info = self._obs, False, False, {}
        for a in chunk[: self.execute]:
            prev = obs
            obs, r, terminated, truncated, info = self.env.step(a)
            total += float(r)
            steps.append({"obs": prev, "action": np.asarray(a), "reward": float(r),
                          "terminated": bool(terminated), "truncated": bool(truncated), "info": info})
            if terminated or truncated:
                break
        self._obs = obs
        out = dict(info)
        out["chunk"] = steps
        return obs, total, terminated, truncated, out


# ---------------------------------------------------------------- recording

class EpisodeRecorder(gym.Wrapper):
    """Write every finished episode to ``<out_dir>/episode_<n>.npz`` in the transition
    layout of :mod:`data.core.schema` (step ``t`` holds obs_t, the action taken and what
    followed; one extra ``is_last`` record holds the final observation), plus
    ``human_action`` [N, A] when an intervention wrapper is inside this one.

    The ``.npz`` has only numeric arrays (load with ``allow_pickle=False``); ``meta`` is
    a JSON string (tasks, episode index, length, return, success, wall time).
    """

    def __init__(self, env: gym.Env, out_dir: str | os.PathLike, *, start_episode: int = 0,
                 on_episode: Callable[[Path, dict], None] | None = None):
        super().__init__(env)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.episode = int(start_episode)
        self.on_episode = on_episode
        self._records: list[dict[str, Any]] = []
        self._obs = None
        self._t0 = 0.0
        self.last_path: Path | None = None

    def reset(self, **kwargs):
        if self._records:
            self._flush(final_obs=self._obs, interrupted=True)
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        self._t0 = time.time()
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        intervened = bool(info.get("intervened", False))
        applied = info.get("human_action") if intervened else action
        rec = {k: v for k, v in self._obs.items()}
        rec.update(
            action=np.asarray(applied, np.float32).reshape(self.env.action_space.shape),
            reward=np.float32(reward), terminated=bool(terminated), truncated=bool(truncated),
            intervened=intervened, is_last=False, success=bool(info.get("is_success", False)),
            policy_version=np.int64(info.get("policy_version", -1)), episode=np.int64(self.episode),
            step=np.int64(len(self._records)),
        )
        self._records.append(rec)
        self._obs = obs
        if terminated or truncated:
            self._flush(final_obs=obs, interrupted=False)
        return obs, reward, terminated, truncated, info

    def _flush(self, final_obs, interrupted: bool) -> None:
        last = {k: v for k, v in final_obs.items()}
        a_shape = self.env.action_space.shape
        last.update(action=np.zeros(a_shape, np.float32), reward=np.float32(0), terminated=False,
                    truncated=interrupted, intervened=False, is_last=True,
                    success=bool(self._records[-1]["success"]), policy_version=np.int64(-1),
                    episode=np.int64(self.episode), step=np.int64(len(self._records)))
        if interrupted:  # cut by a reset: the last real step is marked truncated
            self._records[-1]["truncated"] = True
        recs = self._records + [last]
        arrays: dict[str, np.ndarray] = {}
        for k in recs[0]:
            if k == TASK:
                continue
            stacked = np.stack([np.asarray(r[k]) for r in recs])
            dtype = STEP_ARRAYS.get(k)
            arrays[k] = stacked.astype(dtype, copy=False) if dtype else stacked
        meta = {
            "episode": self.episode, "length": len(self._records),
            "return": float(sum(float(r["reward"]) for r in self._records)),
            "success": bool(any(r["success"] for r in self._records)),
            "interventions": int(sum(bool(r["intervened"]) for r in self._records)),
            "tasks": [str(r.get(TASK, "")) for r in recs], "wall_s": time.time() - self._t0,
            "interrupted": interrupted,
        }
        path = self.out_dir / f"episode_{self.episode:06d}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        os.replace(tmp, path)
        self.last_path = path
        if self.on_episode is not None:
            self.on_episode(path, meta)
        self._records = []
        self.episode += 1

    def close(self):
        if self._records and self._obs is not None:
            self._flush(final_obs=self._obs, interrupted=True)
        super().close()


def load_episode(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Read an :class:`EpisodeRecorder` file: (arrays, meta)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(bytes(z["meta"]).decode())
    return arrays, meta


# ---------------------------------------------------------------- reward classifier

def _conv2d_nhwc(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int) -> np.ndarray:
    """Valid 2-D convolution, x [N, H, W, C], w [O, C, k, k] (torch layout), b [O]."""
    n, h, wd, c = x.shape
    o, ci, k, _ = w.shape
    assert ci == c, (ci, c)
    oh, ow = (h - k) // stride + 1, (wd - k) // stride + 1
    sn, sh, sw, sc = x.strides
    patches = np.lib.stride_tricks.as_strided(
        x, (n, oh, ow, k, k, c), (sn, sh * stride, sw * stride, sh, sw, sc), writeable=False)
    # [N, oh, ow, k, k, C] x [k, k, C, O]
    wk = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(k * k * c, o)
    out = patches.reshape(n * oh * ow, k * k * c) @ wk + b
    return out.reshape(n, oh, ow, o)


class RewardClassifier:
    """A small CNN success classifier, run with numpy (no torch in envs/).

    Architecture (shared by ``tools/train_reward_classifier.py``, which trains it with
    torch and saves it with :meth:`save`): per camera, the image is resized to
    ``input_size`` and scaled to [0, 1], then conv layers ``(out, k, stride)`` + ReLU,
    global average pooling; the camera features are concatenated, then a linear layer to
    one logit. Weights use torch's layouts (conv [O, C, k, k], linear [out, in]).
    """

    def __init__(self, cameras: Sequence[str], input_size: int, convs: Sequence[Sequence[int]],
                 params: Mapping[str, np.ndarray], threshold: float = 0.5):
        self.cameras = list(cameras)
        self.input_size = int(input_size)
        self.convs = [tuple(int(v) for v in c) for c in convs]
        self.params = {k: np.asarray(v, np.float32) for k, v in params.items()}
        self.threshold = float(threshold)

    def config(self) -> dict:
        return {"cameras": self.cameras, "input_size": self.input_size,
                "convs": [list(c) for c in self.convs], "threshold": self.threshold, "version": 1}

    def save(self, path: str | os.PathLike) -> None:
        cfg = np.frombuffer(json.dumps(self.config()).encode(), np.uint8)
        np.savez(path, __config__=cfg, **self.params)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RewardClassifier":
        with np.load(path, allow_pickle=False) as z:
            cfg = json.loads(bytes(z["__config__"]).decode())
            params = {k: z[k] for k in z.files if k != "__config__"}
        return cls(cfg["cameras"], cfg["input_size"], cfg["convs"], params, cfg.get("threshold", 0.5))

    def preprocess(self, images: np.ndarray) -> np.ndarray:
        """uint8 [N, H, W, 3] -> float32 [N, S, S, 3] in [0, 1]."""
        s = self.input_size
        out = np.stack([resize_image(np.asarray(im, np.uint8), s) for im in images])
        return out.astype(np.float32) / 255.0

    def logits(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """``batch``: camera key (``observation.images.<cam>`` or ``<cam>``) -> uint8 [N, H, W, 3]."""
        feats = []
        for ci, cam in enumerate(self.cameras):
            imgs = batch.get(OBS_IMAGE_PREFIX + cam, batch.get(cam))
            if imgs is None:
                raise KeyError(f"reward classifier needs camera {cam!r}")
            x = self.preprocess(np.asarray(imgs))
            for li, (_, _, stride) in enumerate(self.convs):
                x = np.maximum(_conv2d_nhwc(x, self.params[f"cam{ci}.conv{li}.weight"],
                                            self.params[f"cam{ci}.conv{li}.bias"], stride), 0.0)
            feats.append(x.mean(axis=(1, 2)))
        f = np.concatenate(feats, axis=1)
        return (f @ self.params["head.weight"].T + self.params["head.bias"]).reshape(-1)

    def predict_proba(self, obs: Mapping[str, Any]) -> float:
        """Success probability of one observation dict."""
        batch = {OBS_IMAGE_PREFIX + c: np.asarray(obs[OBS_IMAGE_PREFIX + c])[None] for c in self.cameras}
        z = float(self.logits(batch)[0])
        return float(1.0 / (1.0 + np.exp(-z)))


class RewardClassifierReward(gym.Wrapper):
    """Reward from a trained success classifier (``tools/train_reward_classifier.py``).

    Reward = 1.0 when the classifier's success probability is >= ``threshold`` (default:
    the one saved with it); with ``terminate`` the episode then terminates. The env's own
    success is kept in ``info["env_success"]``; ``info["is_success"]`` becomes the
    classifier's verdict and ``info["success_prob"]`` its probability.
    """

    def __init__(self, env: gym.Env, path: str | os.PathLike | None = None, threshold: float | None = None,
                 terminate: bool = True, model: RewardClassifier | None = None):
        super().__init__(env)
        if model is None:
            if path is None:
                raise ValueError("give a classifier path or model")
            model = RewardClassifier.load(path)
        self.model = model
        self.threshold = float(model.threshold if threshold is None else threshold)
        self.terminate_on_success = bool(terminate)
        missing = [c for c in model.cameras if OBS_IMAGE_PREFIX + c not in env.observation_space.spaces]
        if missing:
            raise ValueError(f"reward classifier reads cameras {missing} that the env does not have")

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        p = self.model.predict_proba(obs)
        success = p >= self.threshold
        info["env_success"] = bool(info.get("is_success", False))
        info["success_prob"] = p
        info["is_success"] = success
        if success and self.terminate_on_success:
            terminated = True
        return obs, float(success), bool(terminated), bool(truncated), info
