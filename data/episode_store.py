"""LeRobot-backed episode store: every finished episode goes into a LeRobot v3.0 dataset.

The dataset lives in the run directory (``<run_dir>/dataset`` by default) and is written
through ``lerobot``'s own dataset writer (``LeRobotDataset.create / resume``, ``add_frame``,
``save_episode``), so ``LeRobotDataset(repo_id, root=...)`` and every lerobot tool load it.
One Tandem record (:mod:`data.core.schema`) is one dataset frame:

=========================== ========================== =====================================
frame feature               dtype / shape              from the record
=========================== ========================== =====================================
observation.state           float32 [S]                observation.state
observation.images.<cam>    video or image [H, W, 3]   observation.images.<cam> (uint8)
action                      float32 [A]                action
next.reward                 float32 [1]                reward
next.terminated             bool [1]                   terminated
next.truncated              bool [1]                   truncated (kept apart)
next.success                bool [1]                   success
intervened                  bool [1]                   intervened
is_last                     bool [1]                   is_last (final observation record)
policy_version              int64 [1]                  policy_version
actor_id                    string                     the batch's actor id
actor_episode               int64 [1]                  episode (the actor's episode id)
actor_seq                   int64 [1]                  the record's sequence number
task (LeRobot task)         tasks.parquet              task instruction
=========================== ========================== =====================================

``frame_index`` equals the record's ``step``. Each episode ends with its ``is_last`` frame
(action zeros): it carries the final observation, which a truncated episode needs for
bootstrapping. Tools that want (obs, action) pairs only drop ``is_last`` frames.

Durability
----------
An episode is **durable** once a *commit* that contains it has completed: its parquet rows,
its video (or image) data and its episode metadata are in files that have been closed and
fsynced, and ``.tandem/commit.json`` -- written to a temporary name, fsynced, atomically
renamed, directory fsynced -- names the dataset state that includes it. Only then does the
store report it durable (``on_durable``), and only then does the learner acknowledge its
records to the actor (:mod:`learner.ingest`); until then the actor's spool keeps them.

Crash safety: a commit never modifies a file that an earlier commit made durable. After
each commit the writer is *sealed*: its parquet writers are closed and the next episode
starts new data / metadata / video files. ``meta/info.json``, ``stats.json`` and
``tasks.parquet`` (which lerobot rewrites in place) are copied into the commit record. On
open, :meth:`EpisodeStore.recover` deletes every data, metadata and video file that no
commit names and restores the three metadata files from the record, so a learner killed at
any instant (SIGKILL mid-write included) restarts with a dataset that loads and holds
exactly the committed episodes: an episode is never half present.

Disk full (or any OSError while writing): the commit is rolled back the same way (its new
files deleted, metadata restored), the error is logged with the free space, the episodes
stay queued and unacknowledged, and the writer retries with backoff. Training goes on from
the in-memory buffer, and earlier episodes stay readable.

Reading
-------
:func:`read_episodes` reads any local LeRobot v3.0 dataset (Tandem's or not) with pyarrow
and decodes each video file once, sequentially, with PyAV (no per-frame seeking).
:meth:`EpisodeStore.load_into` refills a replay buffer with the newest committed episodes,
up to its capacity.
"""

from __future__ import annotations

from data.fsutil import fsync_path

import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.transitions import TransitionBatch
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.data.episode_store")

COMMIT_DIR = ".tandem"
COMMIT_FILE = "commit.json"
COMMIT_VERSION = 1
DEFAULT_REPO_ID = "tandem/replay"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
_CHUNK_FILE = re.compile(r"chunk-(\d+)/file-(\d+)\.(parquet|mp4)$")

# record key -> frame feature (scalars are stored with shape (1,), lerobot's convention)
SCALAR_FEATURES: dict[str, tuple[str, str]] = {
    "reward": ("next.reward", "float32"),
    "terminated": ("next.terminated", "bool"),
    "truncated": ("next.truncated", "bool"),
    "success": ("next.success", "bool"),
    "intervened": ("intervened", "bool"),
    "is_last": ("is_last", "bool"),
    "policy_version": ("policy_version", "int64"),
    "episode": ("actor_episode", "int64"),
}


class StoreError(RuntimeError):
    """The dataset on disk cannot be used (not Tandem's, another env spec, corrupted)."""


def _lerobot():
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
    if _DISK_FULL_SEEN not in img_log.handlers:
        img_log.addHandler(_DISK_FULL_SEEN)
    try:
        import av

        av.logging.set_level(av.logging.ERROR)
    except Exception:  # pragma: no cover
        pass
    return LeRobotDataset


def build_features(spec: EnvSpec, *, video: bool = True) -> dict[str, dict]:
    """LeRobot feature dict for an env spec (see the module docstring)."""
    feats: dict[str, dict] = {
        OBS_STATE: {"dtype": "float32", "shape": (spec.state_dim,), "names": None},
    }
    for k in spec.image_keys:
        h, w, c = spec.cameras[k[len(OBS_IMAGE_PREFIX):]]
        feats[k] = {"dtype": "video" if video else "image", "shape": (h, w, c),
                    "names": ["height", "width", "channels"]}
    feats["action"] = {"dtype": "float32", "shape": (spec.action_dim,), "names": None}
    for name, dt in SCALAR_FEATURES.values():
        feats[name] = {"dtype": dt, "shape": (1,), "names": None}
    feats["actor_id"] = {"dtype": "string", "shape": (1,), "names": None}
    feats["actor_seq"] = {"dtype": "int64", "shape": (1,), "names": None}
    return feats


@dataclass
class Episode:
    """A finished episode of one actor: records in step order (the last one ``is_last``),
    in the schema layout, with each record's sequence number."""

    actor_id: str
    episode: int
    arrays: dict[str, np.ndarray]
    tasks: list[str]
    seqs: np.ndarray

    def __len__(self) -> int:
        return int(self.arrays["reward"].shape[0])

    @property
    def first_seq(self) -> int:
        return int(self.seqs.min())

    @property
    def last_seq(self) -> int:
        return int(self.seqs.max())

    @property
    def key(self) -> tuple[str, int]:
        return self.actor_id, self.episode

    @classmethod
    def from_batch(cls, batch: TransitionBatch) -> "Episode":
        """One batch holding exactly one whole episode (tests, tools)."""
        eps = np.unique(batch.arrays["episode"])
        if len(eps) != 1:
            raise ValueError(f"batch holds episodes {eps.tolist()}, expected one")
        return cls(batch.actor_id, int(eps[0]), dict(batch.arrays), list(batch.tasks),
                   np.arange(batch.first_seq, batch.first_seq + len(batch), dtype=np.int64))


# ---- small file helpers ---------------------------------------------------------------------




def _fsync_dir(path: Path) -> None:
    try:
        fsync_path(path)
    except OSError:  # pragma: no cover - some filesystems refuse directory fsync
        pass


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _chunk_file(path: Path) -> tuple[int, int] | None:
    m = _CHUNK_FILE.search(path.as_posix())
    return (int(m.group(1)), int(m.group(2))) if m else None


def _free_mb(path: Path) -> float:
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize / 2**20
    except OSError:  # pragma: no cover
        return float("nan")


_DISK_FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
              errno.EFBIG: "file too large"}


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


_DISK_FULL_SEEN = _DiskFullSeen()


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


def _features_match(on_disk: dict, wanted: dict) -> str | None:
    """Return a description of the first difference that matters, or None."""
    for k, ft in wanted.items():
        got = on_disk.get(k)
        if got is None:
            return f"feature {k!r} missing"
        if got["dtype"] != ft["dtype"] or list(got["shape"]) != list(ft["shape"]):
            return (f"feature {k!r} is {got['dtype']}{list(got['shape'])}, this run needs "
                    f"{ft['dtype']}{list(ft['shape'])}")
    extra = sorted(set(on_disk) - set(wanted) - {"timestamp", "frame_index", "episode_index",
                                                  "index", "task_index"})
    return f"unexpected features {extra}" if extra else None


# ---- the store --------------------------------------------------------------------------------


class EpisodeStore:
    """Appends finished episodes to a LeRobot dataset from a background thread.

    ``submit(episode)`` queues; the writer thread groups whatever is queued into one commit
    (at most ``max_episodes_per_commit``, at most one commit per ``commit_interval_s``),
    then calls ``on_durable(durable, dropped)``. ``ack_preview(episodes)`` (optional) is asked,
    just before a commit, for the per-actor acknowledged sequence numbers that hold once
    those episodes are durable; they are stored in the commit record so that a restarted
    learner knows what it acknowledged (:attr:`acked`).
    """

    def __init__(
        self,
        root: str | Path,
        spec: EnvSpec,
        *,
        fps: int = 10,
        video: bool = True,
        repo_id: str = DEFAULT_REPO_ID,
        vcodec: str | None = None,
        commit_interval_s: float = 0.0,
        max_episodes_per_commit: int = 32,
        retry_min_s: float = 1.0,
        retry_max_s: float = 60.0,
        fsync: bool = True,
    ):
        self.root = Path(root)
        self.spec = spec
        self.fps = int(fps)
        self.video = bool(video)
        self.repo_id = repo_id
        self.vcodec = vcodec
        self.commit_interval_s = float(commit_interval_s)
        self.max_episodes_per_commit = max(1, int(max_episodes_per_commit))
        self.retry_min_s = float(retry_min_s)
        self.retry_max_s = float(retry_max_s)
        self.fsync = fsync
        self.features = build_features(spec, video=self.video)
        if self.video and (vcodec or "libsvtav1") == "libsvtav1":
            small = {c: s for c, s in spec.cameras.items() if min(s[0], s[1]) < 32}
            if small:  # SVT-AV1 kills the process (SIGFPE) on tiny frames
                raise StoreError(f"cameras {small} are smaller than 32x32: too small to store as "
                                 "AV1 video; set buffer.video=false (PNG images) or another vcodec")
        self.on_durable: Callable[[list[Episode], list[Episode]], None] | None = None
        self.ack_preview: Callable[[list[Episode]], dict[str, int]] | None = None
        self.counters: Counter[str] = Counter()
        self.last_error: str | None = None
        self.acked: dict[str, int] = {}
        self.max_episode: dict[str, int] = {}
        self.total_episodes = 0
        self.total_frames = 0
        self._commit_no = 0
        self._last_files: dict[str, list[int] | None] = {}
        self._ds = None  # LeRobotDataset in write mode, sealed between commits
        self._cv = threading.Condition()
        self._queue: deque[Episode] = deque()
        self._writing = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._failures: Counter[tuple[str, int]] = Counter()
        self._needs_recover = False
        self.recovered_files = 0  # files of an unfinished commit removed by the last recover()
        self._LeRobotDataset = _lerobot()
        self._open()

    # ---- opening, recovery, commits ------------------------------------------------------

    @property
    def commit_path(self) -> Path:
        return self.root / COMMIT_DIR / COMMIT_FILE

    def _open(self) -> None:
        if self.commit_path.exists():
            self.recover()
            return
        info = self.root / INFO_PATH
        if self.root.exists() and any(self.root.iterdir()):
            total = 0
            if info.exists():
                try:
                    total = int(json.loads(info.read_text()).get("total_episodes", 0))
                except (ValueError, OSError):
                    total = 0
            if total > 0:
                raise StoreError(
                    f"{self.root} holds a LeRobot dataset that Tandem did not write (no "
                    f"{COMMIT_DIR}/{COMMIT_FILE}); use another buffer.dataset_dir, or load it "
                    "as demonstrations (buffer.demos)")
            log.warning("%s: removing an unfinished dataset creation", self.root)
            shutil.rmtree(self.root)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self._ds = self._LeRobotDataset.create(
            self.repo_id, fps=self.fps, features=self.features, root=self.root,
            use_videos=self.video, video_backend="pyav", **self._encoder_kwargs())
        self._write_commit({}, {})
        log.info("episode store: created LeRobot dataset %s (%s)", self.root,
                 "video" if self.video else "images")

    def _encoder_kwargs(self) -> dict:
        if not self.vcodec:
            return {}
        from lerobot.configs import RGBEncoderConfig

        return {"rgb_encoder": RGBEncoderConfig(vcodec=self.vcodec)}

    def _kinds(self) -> dict[str, Path]:
        kinds = {"data": self.root / "data", "meta/episodes": self.root / "meta" / "episodes"}
        for k in self.spec.image_keys:
            if self.video:
                kinds[f"videos/{k}"] = self.root / "videos" / k
        return kinds

    def recover(self) -> None:
        """Bring the directory back to the last commit (see the module docstring)."""
        rec = json.loads(self.commit_path.read_text())
        if rec.get("version") != COMMIT_VERSION:
            raise StoreError(f"{self.commit_path}: unknown commit record version {rec.get('version')}")
        diff = _features_match(rec["info"]["features"], self.features)
        if diff:
            raise StoreError(f"{self.root} was written for another env spec or camera storage "
                             f"({diff}); use another buffer.dataset_dir")
        removed = 0
        last_files = rec["last_files"]
        for kind, d in self._kinds().items():
            last = last_files.get(kind)
            if not d.exists():
                continue
            for p in sorted(d.rglob("*")):
                if not p.is_file():
                    continue
                cf = _chunk_file(p.relative_to(d))
                if cf is None or last is None or list(cf) > list(last):
                    p.unlink()
                    removed += 1
        for extra in [self.root / "images", *self.root.glob("tmp*")]:
            if extra.is_dir():  # frames staged by lerobot's writer for an unfinished episode
                removed += sum(1 for p in extra.rglob("*") if p.is_file())
                shutil.rmtree(extra, ignore_errors=True)
            elif extra.exists():
                extra.unlink()
                removed += 1
        for rel, size in rec["sizes"].items():
            p = self.root / rel
            if not p.exists() or p.stat().st_size != size:
                raise StoreError(f"{p}: committed file is missing or has the wrong size "
                                 f"(expected {size} bytes): the dataset was changed outside Tandem")
        self._restore_meta(rec)
        self.recovered_files = removed
        if removed:
            log.warning("episode store %s: removed %d file(s) of an unfinished commit; the dataset "
                        "holds the %d committed episode(s)", self.root, removed, rec["total_episodes"])
        self._apply_record(rec)
        self._ds = None

    def _restore_meta(self, rec: dict) -> None:
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.root / INFO_PATH,
                      json.dumps(rec["info"], indent=4, ensure_ascii=False).encode())
        stats = self.root / STATS_PATH
        if rec.get("stats") is not None:
            _atomic_write(stats, json.dumps(rec["stats"], indent=4, ensure_ascii=False).encode())
        elif stats.exists():
            stats.unlink()
        tasks_path = self.root / TASKS_PATH
        tasks = rec.get("tasks") or []
        if tasks:
            import pandas as pd

            df = pd.DataFrame({"task_index": range(len(tasks))}, index=pd.Index(tasks, name="task"))
            tmp = tasks_path.with_name(".tasks.parquet.tmp")
            df.to_parquet(tmp)
            if self.fsync:
                fsync_path(tmp)
            os.replace(tmp, tasks_path)
        elif tasks_path.exists():
            tasks_path.unlink()
        _fsync_dir(meta)

    def _apply_record(self, rec: dict) -> None:
        self._commit_no = int(rec["commit"])
        self.total_episodes = int(rec["total_episodes"])
        self.total_frames = int(rec["total_frames"])
        self._last_files = dict(rec["last_files"])
        self.acked = {k: int(v) for k, v in rec.get("acked", {}).items()}
        self.max_episode = {k: int(v) for k, v in rec.get("max_episode", {}).items()}

    def _write_commit(self, acked: dict[str, int], max_episode: dict[str, int]) -> None:
        from lerobot.datasets.utils import serialize_dict

        meta = self._ds.meta
        last_row = meta.episodes[-1] if meta.episodes is not None and len(meta.episodes) else None
        last_files: dict[str, list[int] | None] = {}
        sizes: dict[str, int] = {}
        for kind in self._kinds():
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
            sizes[rel] = (self.root / rel).stat().st_size
        tasks: list[str] = []
        if meta.tasks is not None and len(meta.tasks):
            tasks = [str(t) for t in meta.tasks.sort_values("task_index").index]
        acked_all = {**self.acked, **{k: int(v) for k, v in acked.items()}}
        max_ep = dict(self.max_episode)
        for k, v in max_episode.items():
            max_ep[k] = max(int(v), max_ep.get(k, -1))
        rec = {
            "version": COMMIT_VERSION, "commit": self._commit_no + 1,
            "total_episodes": int(meta.total_episodes), "total_frames": int(meta.total_frames),
            "last_files": last_files, "sizes": sizes, "info": meta.info.to_dict(),
            "stats": serialize_dict(meta.stats) if meta.stats is not None else None,
            "tasks": tasks, "acked": acked_all, "max_episode": max_ep, "time": time.time(),
        }
        d = self.root / COMMIT_DIR
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.commit_path, json.dumps(rec).encode())
        self._apply_record(rec)

    def _ensure_writer(self):
        if self._ds is None:
            self._ds = self._LeRobotDataset.resume(
                self.repo_id, root=self.root, video_backend="pyav", **self._encoder_kwargs())
            _check_writer_internals(self._ds)
        return self._ds

    def _seal(self) -> None:
        """Close the writer's files so that the next episode starts new ones (see module
        docstring). Uses lerobot 0.6's writer internals, checked by _check_writer_internals."""
        ds = self._ds
        w, m = ds.writer, ds.meta
        w.close_writer()
        m._close_writer()
        last = m.latest_episode
        if last is not None:
            m.episodes = [{k: (v[0] if isinstance(v, list) else v) for k, v in last.items()}]
            m.latest_episode = None
            w._latest_episode = None

    def _abandon_writer(self) -> None:
        """Drop a writer after a failed commit without letting it write anything else."""
        ds, self._ds = self._ds, None
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

    def _fsync_session(self, before: dict[str, list[int] | None]) -> None:
        if not self.fsync:
            return
        dirs: set[Path] = {self.root, self.root / "meta"}
        for kind, d in self._kinds().items():
            if not d.exists():
                continue
            last = before.get(kind)
            for p in d.rglob("*"):
                if p.is_file():
                    cf = _chunk_file(p.relative_to(d))
                    if cf is not None and (last is None or list(cf) > list(last)):
                        fsync_path(p)
                        dirs.update({p.parent, p.parent.parent})
        for rel in (INFO_PATH, STATS_PATH, TASKS_PATH):
            p = self.root / rel
            if p.exists():
                fsync_path(p)
        for d in dirs:
            _fsync_dir(d)

    def _write_episode(self, ep: Episode) -> None:
        ds = self._ensure_writer()
        import datasets

        datasets.disable_progress_bars()  # lerobot's metadata loading turns them back on
        a = ep.arrays
        n = len(ep)
        seqs = np.asarray(ep.seqs, np.int64)
        for i in range(n):
            frame: dict[str, Any] = {OBS_STATE: a[OBS_STATE][i], "action": a["action"][i]}
            for k in self.spec.image_keys:
                frame[k] = a[k][i]
            for key, (name, dt) in SCALAR_FEATURES.items():
                frame[name] = np.asarray(a[key][i : i + 1], dtype=dt)
            frame["actor_id"] = ep.actor_id
            frame["actor_seq"] = seqs[i : i + 1]
            frame["task"] = ep.tasks[i]
            ds.add_frame(frame)
        ds.save_episode(parallel_encoding=False)

    def write(self, episodes: Sequence[Episode]) -> tuple[list[Episode], list[Episode]]:
        """Write ``episodes`` as one commit (synchronously, on the caller's thread; the writer
        thread calls this). Returns (durable, dropped): an episode whose frames lerobot
        refused three times is dropped with a logged reason. Raises after rolling the commit
        back (disk full, I/O error, ...): nothing of it stays on disk."""
        before = dict(self._last_files)
        seen = _DISK_FULL_SEEN.seen
        done: list[Episode] = []
        dropped: list[Episode] = []
        for ep in episodes:
            if self._failures[ep.key] >= 3:
                log.error("episode store: dropping episode %d of actor %s: lerobot refused it %d "
                          "times", ep.episode, ep.actor_id, self._failures[ep.key])
                dropped.append(ep)
                self.counters["dropped_episodes"] += 1
            else:
                done.append(ep)
        try:
            for ep in done:
                try:
                    self._write_episode(ep)
                except Exception as exc:
                    if _DISK_FULL_SEEN.seen > seen and not is_disk_full(exc):
                        raise OSError(errno.ENOSPC, f"No space left on device (lerobot's image "
                                      f"writer; then: {exc})") from exc
                    if not is_disk_full(exc):
                        self._failures[ep.key] += 1
                    raise
            if self._ds is not None:
                self._seal()
            else:
                self._ensure_writer()
            self._fsync_session(before)
            settled = done + dropped
            if self.ack_preview is not None:
                acked = self.ack_preview(settled)
            else:
                acked = {}
                for ep in settled:
                    acked[ep.actor_id] = max(acked.get(ep.actor_id, -1), ep.last_seq)
            max_ep: dict[str, int] = {}
            for ep in done:
                max_ep[ep.actor_id] = max(max_ep.get(ep.actor_id, -1), ep.episode)
            self._write_commit(acked, max_ep)
        except BaseException:
            self._rollback()
            raise
        for ep in done + dropped:
            self._failures.pop(ep.key, None)
        self.counters["commits"] += 1
        self.counters["episodes"] += len(done)
        self.counters["frames"] += sum(len(e) for e in done)
        return done, dropped

    def _rollback(self) -> None:
        self._abandon_writer()
        try:
            self.recover()
        except OSError as exc:  # retried before the next write
            log.error("episode store: rollback of %s incomplete (%s); retrying before the next "
                      "write", self.root, exc)
            self._needs_recover = True

    # ---- the writer thread -----------------------------------------------------------------

    def start(self) -> "EpisodeStore":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-episode-store",
                                            daemon=True)
            self._thread.start()
        return self

    def submit(self, episode: Episode) -> None:
        """Queue a finished episode. After :meth:`close` it is not written (and so never
        acknowledged: the actor resends it to the next learner)."""
        with self._cv:
            if self._stop:
                log.info("episode store closed: episode %d of actor %s not written", episode.episode,
                         episode.actor_id)
                return
            self._queue.append(episode)
            self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Episodes queued or being written (not yet durable)."""
        with self._cv:
            return len(self._queue) + self._writing

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted episode is durable or dropped; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._cv.notify_all()
            while self._queue or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left if left is not None else 0.5)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout``), then stop. Episodes left unwritten stay
        unacknowledged: actors resend them to the next learner."""
        if self._thread is not None:
            self.flush(timeout)
        with self._cv:
            self._stop = True
            left = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))
        if left:
            log.warning("episode store: %d finished episode(s) not written at shutdown; actors "
                        "resend them", left)
        self._abandon_writer()

    def _run(self) -> None:
        backoff = 0.0
        last_commit = 0.0
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                wait = last_commit + self.commit_interval_s - time.monotonic()
                if wait > 0:
                    self._cv.wait(timeout=wait)
                    if self._stop:
                        return
                batch = [self._queue.popleft()
                         for _ in range(min(len(self._queue), self.max_episodes_per_commit))]
                self._writing = len(batch)
            try:
                if self._needs_recover:
                    self.recover()
                    self._needs_recover = False
                done, dropped = self.write(batch)
            except Exception as exc:
                backoff = min(self.retry_max_s, max(self.retry_min_s, 2 * backoff))
                self._report_failure(exc, len(batch), backoff)
                with self._cv:
                    self._queue.extendleft(reversed(batch))
                    self._writing = 0
                    self._cv.notify_all()
                    self._cv.wait(timeout=backoff)
                continue
            if backoff:
                log.warning("episode store: writing to %s works again", self.root)
                self.last_error = None
            backoff = 0.0
            last_commit = time.monotonic()
            try:
                if self.on_durable is not None:
                    self.on_durable(done, dropped)
            except Exception:  # pragma: no cover - a bug in the callback
                log.exception("episode store: on_durable callback failed")
            with self._cv:
                self._writing = 0
                self._cv.notify_all()

    def _report_failure(self, exc: Exception, n: int, retry_s: float) -> None:
        self.counters["write_errors"] += 1
        what = is_disk_full(exc)
        if what:
            msg = (f"{what} writing episodes to {self.root} ({_free_mb(self.root):.1f} MB free): "
                   f"{n} episode(s) not written; they stay unacknowledged in the actors' spools "
                   f"and are retried in {retry_s:.0f}s. Training continues on the in-memory "
                   f"buffer; the {self.total_episodes} committed episode(s) stay readable. Free "
                   f"disk space to resume writing.")
            self.counters["disk_full"] += 1
        else:
            msg = (f"writing episodes to {self.root} failed ({type(exc).__name__}: {exc}); "
                   f"{n} episode(s) rolled back and retried in {retry_s:.0f}s")
        if msg != self.last_error or self.counters["write_errors"] % 20 == 1:
            log.error("episode store: %s", msg, exc_info=not what)
        self.last_error = msg

    # ---- reading -----------------------------------------------------------------------------

    def load_into(self, buffer, *, max_records: int | None = None) -> int:
        """Refill ``buffer`` with the newest committed episodes, up to ``max_records``
        (default: the buffer's capacity) records; video decoded once. Returns the number of
        records added."""
        if self.total_episodes == 0:
            return 0
        cap = buffer.capacity if max_records is None else int(max_records)
        added = 0
        t0 = time.monotonic()
        for ep in read_episodes(self.root, max_frames=cap):
            batch = tandem_batch(ep, self.spec)
            buffer.add(batch, restored=True)
            added += len(batch)
        log.info("episode store: refilled the buffer with %d records (%d transitions) from %s "
                 "in %.1fs", added, len(buffer), self.root, time.monotonic() - t0)
        return added


def _check_writer_internals(ds) -> None:
    """The seal step relies on lerobot 0.6 writer attributes; fail loudly if they moved."""
    missing = [name for obj, name in ((ds.writer, "close_writer"), (ds.writer, "_latest_episode"),
                                       (ds.meta, "_close_writer"), (ds.meta, "latest_episode"),
                                       (ds.meta, "episodes"))
               if not hasattr(obj, name)]
    if missing:  # pragma: no cover - depends on the lerobot version
        import lerobot

        raise StoreError(f"lerobot {lerobot.__version__}: dataset writer lacks {missing}; the "
                         "episode store supports lerobot 0.6")


# ---- reading any LeRobot v3.0 dataset ---------------------------------------------------------


@dataclass
class DatasetEpisode:
    """One episode read from a LeRobot dataset: per-frame columns (numpy, scalar features
    squeezed to [L]), camera frames uint8 [L, H, W, 3], and the task string per frame."""

    index: int
    columns: dict[str, np.ndarray]
    images: dict[str, np.ndarray]
    tasks: list[str]
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tasks)


def read_info(root: str | Path) -> dict:
    path = Path(root) / INFO_PATH
    if not path.exists():
        raise FileNotFoundError(f"{root} is not a LeRobot dataset (no {INFO_PATH})")
    info = json.loads(path.read_text())
    if not str(info.get("codebase_version", "")).startswith("v3"):
        raise ValueError(f"{root}: LeRobot dataset version {info.get('codebase_version')}, "
                         "Tandem reads v3.x (convert older ones with lerobot's converter)")
    return info


def read_episode_table(root: str | Path) -> dict[str, np.ndarray]:
    """meta/episodes as numpy columns (without the stats columns), ordered by episode."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted((Path(root) / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        return {}
    tables = []
    for f in files:
        t = pq.read_table(f)
        tables.append(t.select([c for c in t.column_names if not c.startswith("stats/")]))
    table = pa.concat_tables(tables, promote_options="default")
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names
            if c != "tasks"}
    order = np.argsort(cols["episode_index"], kind="stable")
    return {k: v[order] for k, v in cols.items()}


def read_tasks(root: str | Path) -> dict[int, str]:
    path = Path(root) / TASKS_PATH
    if not path.exists():
        return {}
    import pandas as pd

    df = pd.read_parquet(path)
    return {int(i): str(t) for t, i in zip(df.index, df["task_index"])}


class _VideoCursor:
    """Sequential PyAV decoder over one camera's video files: episodes are read in order,
    so each file is decoded once from its first needed frame on."""

    def __init__(self, fps: float):
        self.fps = float(fps)
        self.path: Path | None = None
        self.container = None
        self.frames: Iterator | None = None
        self.last_t = -1.0
        self._held: tuple[float, Any] | None = None

    def _open(self, path: Path, t0: float) -> None:
        import av

        self.close()
        self.container = av.open(str(path))
        stream = self.container.streams.video[0]
        stream.thread_type = "AUTO"
        if t0 > 0:
            self.container.seek(int(t0 / stream.time_base), stream=stream, backward=True,
                                any_frame=False)
        tb = stream.time_base
        self.frames = ((float(f.pts * tb), f) for f in self.container.decode(stream))
        self.path = path
        self.last_t = -1.0
        self._held = None

    def read(self, path: Path, from_ts: float, length: int, shape: tuple) -> np.ndarray:
        if path != self.path or from_ts < self.last_t - 0.5 / self.fps:
            self._open(path, from_ts)
        out = np.empty((length, *shape), np.uint8)
        got = np.zeros(length, bool)
        half = 0.5 / self.fps
        while True:
            if self._held is not None:
                t, frame = self._held
                self._held = None
            else:
                try:
                    t, frame = next(self.frames)
                except StopIteration:
                    break
            i = int(round((t - from_ts) * self.fps))
            if t < from_ts - half:
                continue
            if i >= length:
                self._held = (t, frame)  # first frame of the next episode
                break
            out[i] = frame.to_ndarray(format="rgb24")
            got[i] = True
            self.last_t = t
            if got.all():
                break
        if not got.all():
            raise ValueError(f"{path}: decoded {int(got.sum())} of {length} frames from "
                             f"t={from_ts:.3f}s")
        return out

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None


def _decode_image_column(col) -> np.ndarray:
    import cv2

    cells = col.to_pylist()
    first = None
    out = []
    for c in cells:
        raw = c["bytes"] if isinstance(c, dict) else c
        if raw is None:
            raise ValueError("image cell without embedded bytes")
        img = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        first = img.shape if first is None else first
        out.append(img)
    return np.stack(out) if out else np.zeros((0, 0, 0, 3), np.uint8)


def read_episodes(root: str | Path, *, episodes: Sequence[int] | None = None,
                  max_frames: int | None = None, columns: Sequence[str] | None = None
                  ) -> Iterator[DatasetEpisode]:
    """Yield episodes of a local LeRobot v3.0 dataset in episode order, with camera frames
    decoded (each video file decoded once, sequentially). ``max_frames`` keeps the newest
    episodes whose lengths add up to at most that many frames (at least one episode);
    ``columns`` restricts the non-camera columns read."""
    import pyarrow.parquet as pq

    root = Path(root)
    info = read_info(root)
    feats = info["features"]
    fps = float(info["fps"])
    table = read_episode_table(root)
    if not table:
        return
    ep_index = table["episode_index"].astype(np.int64)
    lengths = table["length"].astype(np.int64)
    sel = np.arange(len(ep_index))
    if episodes is not None:
        want = set(int(e) for e in episodes)
        sel = np.array([i for i in sel if int(ep_index[i]) in want], dtype=np.int64)
    if max_frames is not None and len(sel):
        keep: list[int] = []
        total = 0
        for i in sel[::-1]:
            if keep and total + lengths[i] > max_frames:
                break
            keep.append(int(i))
            total += int(lengths[i])
        sel = np.array(keep[::-1], dtype=np.int64)
    tasks = read_tasks(root)
    cams = [k for k, ft in feats.items() if ft["dtype"] in ("video", "image")]
    video_cams = [k for k in cams if feats[k]["dtype"] == "video"]
    cursors = {k: _VideoCursor(fps) for k in video_cams}
    data_cache: tuple[Path, Any] | None = None
    try:
        for i in sel:
            e = int(ep_index[i])
            c, f = int(table["data/chunk_index"][i]), int(table["data/file_index"][i])
            path = root / info["data_path"].format(chunk_index=c, file_index=f)
            if data_cache is None or data_cache[0] != path:
                t = pq.read_table(path)
                data_cache = (path, t, t.column("episode_index").to_numpy())
            _, t, eidx = data_cache
            rows = np.flatnonzero(eidx == e)
            sub = t.take(rows)
            cols: dict[str, np.ndarray] = {}
            images: dict[str, np.ndarray] = {}
            for name in sub.column_names:
                ft = feats.get(name, {})
                if name in cams:
                    continue
                if columns is not None and name not in columns and name not in (
                        "frame_index", "task_index", "episode_index", "index"):
                    continue
                arr = _column_to_numpy(sub.column(name))
                if arr.ndim == 2 and arr.shape[1] == 1 and list(ft.get("shape", [])) == [1]:
                    arr = arr[:, 0]
                cols[name] = arr
            order = np.argsort(cols["frame_index"], kind="stable")
            cols = {k: v[order] for k, v in cols.items()}
            n = len(order)
            if n != int(lengths[i]):
                raise ValueError(f"{root}: episode {e} has {n} data rows, metadata says {lengths[i]}")
            for k in cams:
                if feats[k]["dtype"] == "image":
                    images[k] = _decode_image_column(sub.column(k))[order]
                else:
                    vc = int(table[f"videos/{k}/chunk_index"][i])
                    vf = int(table[f"videos/{k}/file_index"][i])
                    vpath = root / info["video_path"].format(video_key=k, chunk_index=vc,
                                                             file_index=vf)
                    shape = _hwc(feats[k])
                    images[k] = cursors[k].read(vpath, float(table[f"videos/{k}/from_timestamp"][i]),
                                                n, shape)
            task_idx = cols.get("task_index")
            ep_tasks = ([tasks.get(int(x), "") for x in task_idx] if task_idx is not None
                        else [""] * n)
            yield DatasetEpisode(e, cols, images, ep_tasks, info)
    finally:
        for cur in cursors.values():
            cur.close()


def _column_to_numpy(col) -> np.ndarray:
    """A pyarrow column as numpy: list columns become [N, D] (or deeper), strings object."""
    import pyarrow as pa

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(col)
    shape: list[int] = []
    total = n
    while pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or \
            pa.types.is_large_list(col.type):
        col = col.flatten()
        d = len(col) // total if total else 0
        shape.append(d)
        total *= d
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        arr = np.array(col.to_pylist(), dtype=object)
    else:
        arr = col.to_numpy(zero_copy_only=False)
    return arr.reshape(n, *shape) if shape else arr


def _hwc(ft: dict) -> tuple[int, int, int]:
    """A camera feature's (H, W, C) from its shape and names."""
    shape = tuple(int(x) for x in ft["shape"])
    names = ft.get("names") or []
    if len(shape) == 3 and list(names[:1]) == ["channels"]:
        return shape[1], shape[2], shape[0]
    if len(shape) == 3 and shape[0] in (1, 3) and shape[2] not in (1, 3):
        return shape[1], shape[2], shape[0]
    return shape  # type: ignore[return-value]


def tandem_batch(ep: DatasetEpisode, spec: EnvSpec) -> TransitionBatch:
    """A Tandem-written dataset episode back into a transition batch (records in order)."""
    c = ep.columns
    n = len(ep)
    arrays: dict[str, np.ndarray] = {
        OBS_STATE: np.ascontiguousarray(c[OBS_STATE], np.float32).reshape(n, spec.state_dim),
        "action": np.ascontiguousarray(c["action"], np.float32).reshape(n, spec.action_dim),
        "step": c["frame_index"].astype(np.int64),
    }
    for k in spec.image_keys:
        arrays[k] = ep.images[k]
    for key, (name, dt) in SCALAR_FEATURES.items():
        arrays[key] = c[name].astype(dt)
    actor = str(c["actor_id"][0]) if n else ""
    seqs = c["actor_seq"].astype(np.int64)
    return TransitionBatch(actor, int(seqs[0]) if n else 0, arrays, list(ep.tasks))
