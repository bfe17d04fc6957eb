"""Headless OpenGL selection for the MuJoCo-based simulators (LIBERO, gym-hil, ...).

:func:`configure_rendering` sets ``MUJOCO_GL`` and ``PYOPENGL_PLATFORM``, which only take
effect if they are set before ``mujoco`` (or robosuite / PyOpenGL) is first imported. The
simulator modules call it with their config's ``gl`` key (``auto``, ``egl``, ``osmesa``,
``glfw``) right before they import their simulator; ``auto`` keeps a backend the user
already exported and otherwise prefers OSMesa when its library is present (much faster than
EGL on Mesa's llvmpipe for small images), then EGL.

Importing this module picks the ``auto`` backend at once unless ``MUJOCO_GL`` is exported or
``mujoco`` is already imported (a user who wants an on-screen viewer exports
``MUJOCO_GL=glfw``); :mod:`envs.registry` imports it for that reason. It imports no
simulator itself.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import warnings

GL_BACKENDS = ("egl", "osmesa", "glfw")


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
            f"to {backend} in this process. Import envs.rendering (or export MUJOCO_GL={backend}) "
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


def default_headless() -> None:
    """Pick the ``auto`` backend now, unless the user exported one or mujoco is already in.
    No OpenGL library at all is not an error here: state-only envs still work."""
    if "MUJOCO_GL" in os.environ or "mujoco" in sys.modules:
        return
    try:
        configure_rendering("auto")
    except RuntimeError:
        pass


default_headless()
