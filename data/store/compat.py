"""Everything the store needs from lerobot beyond its public dataset API, in one place:
importing it quietly, noticing disk-full errors its image writer only logs, and the
lerobot 0.6 writer internals used to seal and abandon a writer."""

from __future__ import annotations

import logging
import os
import re

from data.store.features import StoreError


class _DiskFullSeen(logging.Handler):
    """lerobot's image writer logs write errors instead of raising them (the failure then
    shows up later as an unreadable frame): remember when one of them was a full disk."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # pragma: no cover
            return
        if "No space left on device" in text or "Errno 28" in text or "Disk quota" in text:
            self.seen += 1


#: counts disk-full errors logged by lerobot's image writer (installed by import_lerobot)
DISK_FULL_SEEN = _DiskFullSeen()


def import_lerobot():
    """Import lerobot's dataset class (needs ``lerobot[dataset]``), quietly."""
    try:
        import datasets

        datasets.disable_progress_bars()
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the episode store needs lerobot's dataset extra ({exc}); install "
            "'lerobot[dataset]' (datasets, pandas, pyav)"
        ) from exc
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 encoder: errors only
    logging.getLogger("lerobot.configs.video").setLevel(logging.WARNING)
    img_log = logging.getLogger("lerobot.datasets.image_writer")
    if DISK_FULL_SEEN not in img_log.handlers:
        img_log.addHandler(DISK_FULL_SEEN)
    quiet_av()
    _install_video_backend()
    return LeRobotDataset


def quiet_av() -> None:
    """FFmpeg logs errors only. (lerobot's ``get_video_info`` and others call PyAV's
    ``restore_default_callback``, after which FFmpeg prints its info lines to stderr until the
    level is set again: the store calls this before each commit.)"""
    try:
        import av

        av.logging.set_level(av.logging.ERROR)
    except Exception:  # pragma: no cover
        pass


_VIDEO_BACKEND: list[str] = []


def _install_video_backend() -> None:
    """Tandem reads its datasets with PyAV (wheels ship their own FFmpeg) and passes
    ``video_backend="pyav"`` to lerobot; point lerobot's default decoder picker at
    :func:`video_backend`, so a dataset opened without ``video_backend=`` does not print
    torchcodec's load failure each time. Said once, in one line."""
    import sys

    installed = False
    for mod in ("lerobot.utils.import_utils", "lerobot.datasets.lerobot_dataset",
                "lerobot.datasets.video_utils"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "get_safe_default_video_backend", None) not in (None, video_backend):
            m.get_safe_default_video_backend = video_backend
            installed = True
    if installed:
        logging.getLogger("tandem.data.store").info(
            "video decoder: pyav for Tandem's datasets (lerobot's default is picked once, on first use)")


def torchcodec_failure(exc: BaseException) -> str:
    """torchcodec's load failure in a few words: the FFmpeg libraries it looked for when they
    are missing (its message is a traceback per FFmpeg version), else its first line."""
    text = str(exc)
    missing = sorted(set(re.findall(r"(libav\w*\.so\.\d+): cannot open shared object", text)), reverse=True)
    if missing:
        return f"no system FFmpeg, {', '.join(missing)} not found"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:120]


def video_backend() -> str:
    """lerobot's default video decoder in this process, picked once on first use and logged
    in one line: ``torchcodec`` when it loads (it needs a system FFmpeg and takes seconds to
    import, hence not at start-up), else ``pyav``."""
    if _VIDEO_BACKEND:
        return _VIDEO_BACKEND[0]
    import importlib

    try:
        importlib.import_module("torchcodec")
        name, why = "torchcodec", ""
    except Exception as exc:  # no FFmpeg libraries: RuntimeError / OSError / ImportError
        name, why = "pyav", f" (torchcodec does not load here: {torchcodec_failure(exc)})"
    _VIDEO_BACKEND.append(name)
    logging.getLogger("tandem.data.store").info("lerobot's default video decoder: %s%s", name, why)
    return name


def check_writer_internals(ds) -> None:
    """The seal step relies on lerobot 0.6 writer attributes; fail loudly if they moved."""
    missing = [name for obj, name in ((ds.writer, "close_writer"), (ds.writer, "_latest_episode"),
                                       (ds.meta, "_close_writer"), (ds.meta, "latest_episode"),
                                       (ds.meta, "episodes"))
               if not hasattr(obj, name)]
    if missing:  # pragma: no cover - depends on the lerobot version
        import lerobot

        raise StoreError(f"lerobot {lerobot.__version__}: dataset writer lacks {missing}; the "
                         "episode store supports lerobot 0.6")


def seal_writer(ds) -> None:
    """Close the writer's files so that the next episode starts new ones (see the durability
    notes in :mod:`data.store`). Uses lerobot 0.6's writer internals, checked by
    :func:`check_writer_internals`."""
    w, m = ds.writer, ds.meta
    w.close_writer()
    m._close_writer()
    last = m.latest_episode
    if last is not None:
        m.episodes = [{k: (v[0] if isinstance(v, list) else v) for k, v in last.items()}]
        m.latest_episode = None
        w._latest_episode = None


def abandon_writer(ds) -> None:
    """Drop a writer after a failed commit without letting it write anything else."""
    if ds is None:
        return
    for obj in (getattr(ds, "writer", None), getattr(ds, "meta", None)):
        if obj is None:
            continue
        obj._finalized = True
        pq = getattr(obj, "_pq_writer", None)
        if pq is not None:
            try:
                pq.close()
            except Exception:
                pass
            obj._pq_writer = None
    ds._is_finalized = True
