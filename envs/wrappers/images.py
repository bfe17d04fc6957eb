"""Camera image crop / resize, and the :class:`ImageTransform` wrapper that applies them
to every ``observation.images.*`` entry."""

from __future__ import annotations

from typing import Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX


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
