"""Reward from a trained image success classifier, run with numpy (no torch in envs/):
:class:`RewardClassifier` (the model, shared with ``tools/train_reward_classifier.py``)
and :class:`RewardClassifierReward` (the wrapper)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX
from envs.wrappers.images import resize_image


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

    Reward = ``coef`` * 1[success probability >= ``threshold``] (default threshold: the one
    saved with it) + ``env_coef`` * the env's own reward (default 1 and 0: the classifier's 0/1
    alone); with ``terminate`` the episode terminates on a classified success. The env's own
    success and reward are kept in ``info["env_success"]`` / ``info["env_reward"]``;
    ``info["is_success"]`` becomes the classifier's verdict and ``info["success_prob"]`` its
    probability.
    """

    def __init__(self, env: gym.Env, path: str | os.PathLike | None = None, threshold: float | None = None,
                 terminate: bool = True, model: RewardClassifier | None = None, coef: float = 1.0,
                 env_coef: float = 0.0):
        super().__init__(env)
        for name, v in (("coef", coef), ("env_coef", env_coef)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v):
                raise ValueError(f"reward_classifier.{name} must be a finite number, got {v!r}")
        self.coef, self.env_coef = float(coef), float(env_coef)
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
        obs, env_reward, terminated, truncated, info = self.env.step(action)
        p = self.model.predict_proba(obs)
        success = p >= self.threshold
        info["env_success"] = bool(info.get("is_success", False))
        info["env_reward"] = float(env_reward)
        info["success_prob"] = p
        info["is_success"] = success
        if success and self.terminate_on_success:
            terminated = True
        reward = self.coef * float(success) + self.env_coef * float(env_reward)
        return obs, reward, bool(terminated), bool(truncated), info
