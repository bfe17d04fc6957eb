"""Commit records and crash recovery of the episode store's dataset directory.

``<root>/.tandem/commit.json`` names the dataset state of the last completed commit: the
last data / metadata / video file of each kind, the sizes of those files, and copies of the
metadata files lerobot rewrites in place (``info.json``, ``stats.json``, ``tasks.parquet``).
:func:`recover` brings a directory back to that state (see :mod:`data.store`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from data.fsutil import atomic_write, fsync_dir, fsync_path
from data.store.features import INFO_PATH, STATS_PATH, TASKS_PATH, StoreError, features_diff

log = logging.getLogger("tandem.data.store")

COMMIT_DIR = ".tandem"
COMMIT_FILE = "commit.json"
COMMIT_VERSION = 1
_CHUNK_FILE = re.compile(r"chunk-(\d+)/file-(\d+)\.(parquet|mp4)$")

Files = dict[str, "list[int] | None"]  # file kind -> [chunk, file] of its last committed file


def commit_path(root: Path) -> Path:
    return Path(root) / COMMIT_DIR / COMMIT_FILE


def chunk_file(path: Path) -> tuple[int, int] | None:
    """(chunk, file) numbers of a lerobot ``chunk-XXX/file-YYY.ext`` path, or None."""
    m = _CHUNK_FILE.search(path.as_posix())
    return (int(m.group(1)), int(m.group(2))) if m else None


def file_kinds(root: Path, image_keys, video: bool) -> dict[str, Path]:
    """The folders of numbered files the dataset grows: kind -> folder."""
    kinds = {"data": root / "data", "meta/episodes": root / "meta" / "episodes"}
    if video:
        for k in image_keys:
            kinds[f"videos/{k}"] = root / "videos" / k
    return kinds


def read_commit(root: Path, features: dict) -> dict:
    """The commit record, checked against the features this run writes (nothing is changed
    on disk when they differ)."""
    path = commit_path(root)
    rec = json.loads(path.read_text())
    if rec.get("version") != COMMIT_VERSION:
        raise StoreError(f"{path}: unknown commit record version {rec.get('version')}")
    diff = features_diff(rec["info"]["features"], features)
    if diff:
        raise StoreError(f"{root} was written for another env spec, policy extras or camera "
                         f"storage ({diff}); use another buffer.dataset_dir")
    return rec


def recover(root: Path, rec: dict, kinds: dict[str, Path], *, fsync: bool = True) -> int:
    """Delete every data, metadata and video file that the commit ``rec`` does not name and
    restore the metadata files from it. Returns the number of files removed."""
    removed = 0
    last_files = rec["last_files"]
    for kind, d in kinds.items():
        last = last_files.get(kind)
        if not d.exists():
            continue
        for p in sorted(d.rglob("*")):
            if not p.is_file():
                continue
            cf = chunk_file(p.relative_to(d))
            if cf is None or last is None or list(cf) > list(last):
                p.unlink()
                removed += 1
    stale_tmp = [*(root / COMMIT_DIR).glob(".*.tmp"), *(root / "meta").glob(".*.tmp")]
    for extra in [root / "images", *root.glob("tmp*"), *stale_tmp]:
        if extra.is_dir():  # frames staged by lerobot's writer for an unfinished episode
            removed += sum(1 for p in extra.rglob("*") if p.is_file())
            shutil.rmtree(extra, ignore_errors=True)
        elif extra.exists():
            extra.unlink()
            removed += 1
    for rel, size in rec["sizes"].items():
        p = root / rel
        if not p.exists() or p.stat().st_size != size:
            raise StoreError(f"{p}: committed file is missing or has the wrong size "
                             f"(expected {size} bytes): the dataset was changed outside Tandem")
    restore_meta(root, rec, fsync=fsync)
    if removed:
        log.warning("episode store %s: removed %d file(s) of an unfinished commit; the dataset "
                    "holds the %d committed episode(s)", root, removed, rec["total_episodes"])
    return removed


def restore_meta(root: Path, rec: dict, *, fsync: bool = True) -> None:
    """Write info.json, stats.json and tasks.parquet as the commit record has them."""
    meta = root / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    atomic_write(root / INFO_PATH, json.dumps(rec["info"], indent=4, ensure_ascii=False).encode())
    stats = root / STATS_PATH
    if rec.get("stats") is not None:
        atomic_write(stats, json.dumps(rec["stats"], indent=4, ensure_ascii=False).encode())
    elif stats.exists():
        stats.unlink()
    tasks_path = root / TASKS_PATH
    tasks = rec.get("tasks") or []
    if tasks:
        import pandas as pd

        df = pd.DataFrame({"task_index": range(len(tasks))}, index=pd.Index(tasks, name="task"))
        atomic_write(tasks_path, df.to_parquet, fsync=fsync)
    elif tasks_path.exists():
        tasks_path.unlink()
    fsync_dir(meta)


def make_record(root: Path, meta, kinds: dict[str, Path], *, commit: int, acked: dict[str, int],
                max_episode: dict[str, int]) -> dict:
    """The commit record of the dataset state that lerobot's metadata ``meta`` describes
    (its writers sealed)."""
    from lerobot.datasets.utils import serialize_dict

    last_row = meta.episodes[-1] if meta.episodes is not None and len(meta.episodes) else None
    last_files: Files = {}
    sizes: dict[str, int] = {}
    for kind in kinds:
        if last_row is None:
            last_files[kind] = None
            continue
        if kind == "data":
            cf = [int(last_row["data/chunk_index"]), int(last_row["data/file_index"])]
        elif kind == "meta/episodes":
            cf = [int(last_row["meta/episodes/chunk_index"]),
                  int(last_row["meta/episodes/file_index"])]
        else:
            key = kind[len("videos/"):]
            cf = [int(last_row[f"videos/{key}/chunk_index"]),
                  int(last_row[f"videos/{key}/file_index"])]
        last_files[kind] = cf
        ext = "mp4" if kind.startswith("videos/") else "parquet"
        rel = f"{kind}/chunk-{cf[0]:03d}/file-{cf[1]:03d}.{ext}"
        sizes[rel] = (root / rel).stat().st_size
    tasks: list[str] = []
    if meta.tasks is not None and len(meta.tasks):
        tasks = [str(t) for t in meta.tasks.sort_values("task_index").index]
    return {
        "version": COMMIT_VERSION, "commit": int(commit),
        "total_episodes": int(meta.total_episodes), "total_frames": int(meta.total_frames),
        "last_files": last_files, "sizes": sizes, "info": meta.info.to_dict(),
        "stats": serialize_dict(meta.stats) if meta.stats is not None else None,
        "tasks": tasks, "acked": acked, "max_episode": max_episode, "time": time.time(),
    }


def write_record(root: Path, rec: dict) -> None:
    """Make ``rec`` the last commit: written to a temporary name, fsynced, renamed."""
    d = root / COMMIT_DIR
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(commit_path(root), json.dumps(rec).encode())


def fsync_new_files(root: Path, kinds: dict[str, Path], before: Files) -> None:
    """fsync every numbered file written since the commit whose last files were ``before``,
    the metadata files lerobot rewrites, and their directories."""
    dirs: set[Path] = {root, root / "meta"}
    for kind, d in kinds.items():
        if not d.exists():
            continue
        last = before.get(kind)
        for p in d.rglob("*"):
            if p.is_file():
                cf = chunk_file(p.relative_to(d))
                if cf is not None and (last is None or list(cf) > list(last)):
                    fsync_path(p)
                    dirs.update({p.parent, p.parent.parent})
    for rel in (INFO_PATH, STATS_PATH, TASKS_PATH):
        p = root / rel
        if p.exists():
            fsync_path(p)
    for d in dirs:
        fsync_dir(d)
