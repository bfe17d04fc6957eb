"""The LIBERO env's layout, computed from its config alone (no simulator, no gymnasium).

:func:`libero_spec` is what :class:`envs.libero.env.LiberoEnv` built from the same config
exposes before the config-driven wrappers: 8-D state, 7-D action, one ``[H, W, 3]`` image per
configured camera at the rendered size (``render_size``, else ``image_size``, else 128), the
task string, and the suite's time limit. :func:`envs.registry.env_spec` adds the wrappers'
effect (``crop``/``image_size`` resize, ``max_episode_steps``).
"""

from __future__ import annotations

from typing import Any, Mapping

from data.core.spec import EnvSpec
from envs.libero.tasks import SUITE_MAX_STEPS, check_suite

#: LIBERO camera -> observation.images.<key> (OpenVLA-OFT's names)
DEFAULT_CAMERAS: dict[str, str] = {"agentview": "image", "robot0_eye_in_hand": "wrist_image"}
STATE_DIM = 8
ACTION_DIM = 7
DEFAULT_IMAGE_SIZE = 128


def suite_of(cfg: Mapping[str, Any]) -> str:
    """``suite`` (for ``name: libero``) or the env name (``libero_spatial`` ...)."""
    return check_suite(cfg.get("suite") or cfg.get("name"))


def image_hw(size: int | tuple[int, int] | list[int] | None) -> tuple[int, int]:
    if size is None:
        size = DEFAULT_IMAGE_SIZE
    if isinstance(size, int):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


def render_hw(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """The size the simulator renders at: ``render_size``, else ``image_size``, else 128."""
    return image_hw(cfg.get("render_size") or cfg.get("image_size") or DEFAULT_IMAGE_SIZE)


def cameras_of(cfg: Mapping[str, Any]) -> dict[str, str]:
    cams = cfg.get("cameras")
    return dict(DEFAULT_CAMERAS if cams is None else cams)


def libero_spec(cfg: Mapping[str, Any]) -> EnvSpec:
    """The raw env's layout for a LIBERO env config (see the module docstring)."""
    suite = suite_of(cfg)
    h, w = render_hw(cfg)
    return EnvSpec(
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        cameras={key: (h, w, 3) for key in cameras_of(cfg).values()},
        has_task=True,
        max_episode_steps=SUITE_MAX_STEPS[suite],
    )
