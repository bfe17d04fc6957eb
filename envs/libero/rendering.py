"""Camera rendering for LIBERO: offscreen buffer size and ``render_quality``.

LIBERO (robosuite) makes its GL context with a 640x480 offscreen buffer and 4x
multisampling. :class:`render_settings` (a context manager) makes robosuite build the context
with the image size instead, and with ``render_quality="fast"`` without multisampling;
:func:`tune_renderer` then turns off floor reflections and shadows for ``fast``. ``faithful``
keeps LIBERO's look (pixel-identical to LIBERO's own renders).

Software rendering cost is mostly per triangle, not per pixel, so ``fast`` gains more than a
smaller image does; OSMesa is faster than EGL's llvmpipe, so ``gl: auto`` prefers it.
``python -m envs.libero`` times the steps; current figures: docs/benchmarks.md, "Environments".
"""

from __future__ import annotations

import threading

RENDER_QUALITIES = ("faithful", "fast")

_render_local = threading.local()


def check_quality(quality: str) -> str:
    if quality not in RENDER_QUALITIES:
        raise ValueError(f"render_quality must be one of {RENDER_QUALITIES}, got {quality!r}")
    return quality


def settings_for(image_hw: tuple[int, int], quality: str, has_cameras: bool) -> dict[str, int] | None:
    """The GL context settings :class:`render_settings` applies (None: LIBERO's own)."""
    if not has_cameras:
        return None
    h, w = image_hw
    out = {"offwidth": int(w), "offheight": int(h)}
    if quality == "fast":
        out["offsamples"] = 0
    return out


class render_settings:
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


def tune_renderer(sim, quality: str, has_cameras: bool) -> None:
    """Scene flags of ``render_quality="fast"`` (no reflections, no shadows) on a robosuite
    ``sim``. The offscreen buffer size (the image size: same pixels, less work than LIBERO's
    640x480) and the multisample count are applied by :class:`render_settings` when robosuite
    makes its GL context, so the context is never built twice."""
    if not has_cameras or quality != "fast":
        return
    import mujoco

    ctx = getattr(sim, "_render_context_offscreen", None)
    if ctx is not None:
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
