"""Small file-system helpers shared by the episode store and checkpoints: fsync of files
and directories, atomic replacement of a file, free space, and telling a full disk apart
from other write errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, where the filesystem allows it (some refuse directory fsync)."""
    try:
        fsync_path(path)
    except OSError:  # pragma: no cover - depends on the filesystem
        pass


def atomic_write(path: str | Path, data: bytes | Callable[[Path], None], *,
                 fsync: bool = True) -> None:
    """Replace ``path`` atomically: write a temporary ``.<name>.tmp`` next to it (``data``
    bytes, or a callable that writes the file it is given), fsync it, rename it over
    ``path`` and fsync the directory. A crash leaves either the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if callable(data):
        data(tmp)
        if fsync:
            fsync_path(tmp)
    else:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def free_mb(path: str | Path) -> float:
    """Free space (MiB) for unprivileged users on ``path``'s filesystem; NaN if unknown."""
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize / 2**20
    except OSError:  # pragma: no cover
        return float("nan")


_DISK_FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
              errno.EFBIG: "file too large"}


def is_disk_full(exc: BaseException | None) -> str | None:
    """"disk full" (or quota / file size) if ``exc`` or its causes say so, else None. Some
    writers (pyarrow) raise OSError without an errno: their message is checked too."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return _DISK_FULL[exc.errno]
        text = str(exc)
        if "No space left on device" in text or "ENOSPC" in text:
            return "disk full"
        if "Disk quota exceeded" in text:
            return "disk quota exceeded"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None
