"""The camera half of a dataset write, done ahead of the commit in worker processes.

With ``encoder="pool"`` (the default) the store hands each finished episode, as soon as it is
submitted, to a small process pool (:class:`PreparePool`; the workers import only numpy, PyAV
and this package, so they start in about a second). A worker

- encodes one MP4 per camera with PyAV as lerobot's ``encode_video_frames`` does (same stream settings
  and codec options), from the frames in memory -- no PNG staging of every frame -- into
  ``<root>/.tandem/staging/``;
- computes the episode statistics of every column but the commit-numbered ones, in
  lerobot's layout: numeric columns exactly (quantiles by linear interpolation, where lerobot
  interpolates a histogram); cameras over the frames lerobot would sample: min, max,
  mean and std exactly, the quantiles from the exact 256-bin histogram of the uint8 values
  (lerobot interpolates its own histogram, so quantiles differ from lerobot's by well under
  one grey level), in lerobot's layout (per channel, [3, 1, 1], divided by 255).

The commit (:mod:`data.store.append`, on the store's writer thread) then builds the parquet
rows as one Arrow table with lerobot's schema (no ``datasets.Dataset``, whose fingerprinting
and per-row image embedding cost more than the rest of the write for short episodes), joins
the commit's videos into lerobot's files (one re-mux per file, no re-encoding) and updates
the metadata. Video encoding thus runs off the learner's Python threads and in parallel
with commits.

Staged files are not part of the dataset: opening the store empties the staging folder, and
a staged video is moved into ``videos/`` only by a commit, so recovery is unchanged.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.core.spec import EnvSpec
from data.store.episode import Episode
from data.store.features import episode_columns

log = logging.getLogger("tandem.data.store")

STAGING = Path(".tandem") / "staging"


@dataclass
class Prepared:
    """An episode's cameras made ready for :class:`data.store.append.Appender`."""

    videos: dict[str, str] = field(default_factory=dict)  # camera key -> staged mp4
    stats: dict = field(default_factory=dict)  # feature -> episode stats (all but COMMIT_COLUMNS)
    cpu_s: float = 0.0  # CPU seconds the preparation took (in its process)

    def videos_present(self) -> bool:
        return all(os.path.exists(p) for p in self.videos.values())

    def discard(self) -> None:
        for p in self.videos.values():
            shutil.rmtree(os.path.dirname(p), ignore_errors=True)


@dataclass
class PrepareJob:
    """What a worker needs (pickled to it): the episode, the dataset's features, the encoder."""

    episode: Episode
    spec: EnvSpec
    features: dict  # lerobot's feature dict of the dataset (shapes as tuples)
    fps: int
    staging: str
    vcodec: str
    pix_fmt: str
    options: dict[str, str]  # lerobot's codec options of the encoder config, as strings


#: columns numbered at commit time (their stats are computed then)
COMMIT_COLUMNS = ("index", "episode_index", "task_index")
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # lerobot's DEFAULT_QUANTILES (keys q01 ... q99)


def _sample_indices(n: int) -> np.ndarray:
    """lerobot's ``sample_indices``: up to ~n**0.75 (at least 100) evenly spaced frames."""
    k = n if n < 100 else max(100, min(int(n ** 0.75), 10_000))
    return np.round(np.linspace(0, n - 1, k)).astype(int)


def episode_table_columns(ep: Episode, spec: EnvSpec, features: dict, fps: int,
                          *, first_index: int, episode_index: int,
                          task_index: np.ndarray) -> dict[str, np.ndarray]:
    """Every parquet column of an episode (scalar features [n], vectors [n, D]), checked
    against the dataset's features."""
    n = len(ep)
    cols = episode_columns(ep.arrays, n, spec)
    cols["actor_id"] = np.array([ep.actor_id] * n, dtype=object)
    cols["actor_seq"] = np.asarray(ep.seqs, np.int64).reshape(n, 1)
    cols["frame_index"] = np.arange(n, dtype=np.int64)
    cols["timestamp"] = (np.arange(n) / fps).astype(np.float32)  # lerobot: frame_index / fps
    cols["index"] = np.arange(first_index, first_index + n, dtype=np.int64)
    cols["episode_index"] = np.full(n, episode_index, dtype=np.int64)
    cols["task_index"] = np.asarray(task_index, np.int64)
    out: dict[str, np.ndarray] = {}
    for k, ft in features.items():
        if ft["dtype"] in ("video", "image"):
            continue
        if k not in cols:
            raise ValueError(f"episode {ep.episode} of actor {ep.actor_id}: no {k!r} column")
        v = cols[k]
        want = tuple(ft["shape"])
        if ft["dtype"] != "string" and want == (1,):
            v = np.asarray(v).reshape(n)
        elif ft["dtype"] != "string" and tuple(v.shape[1:]) != want:
            raise ValueError(f"episode {ep.episode} of actor {ep.actor_id}: {k!r} has shape "
                             f"{tuple(v.shape[1:])}, the dataset's feature {want}")
        out[k] = v
    return out


def column_stats(cols: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Episode stats of numeric columns in lerobot's layout (``compute_episode_stats``: min,
    max, mean, std over the frames, in float32 or wider, quantiles q01 ... q99 in float64,
    count; a [n] column gives [1]-shaped figures, [n, D] gives [D]). Quantiles are exact
    (linear interpolation) where lerobot interpolates a histogram; strings are skipped."""
    out = {}
    for k, v in cols.items():
        if v.dtype == object or v.dtype.kind in "USO":
            continue
        x = v.reshape(len(v), 1) if v.ndim == 1 else v
        x = x.astype(np.result_type(x.dtype, np.float32), copy=False)
        mean = x.mean(axis=0)
        st = {"min": x.min(axis=0), "max": x.max(axis=0), "mean": mean,
              "std": np.sqrt(np.maximum(0, (x * x).mean(axis=0) - mean * mean)),
              "count": np.array([len(v)], dtype=np.int64)}
        qs = np.quantile(x.astype(np.float64), QUANTILES, axis=0)
        for q, val in zip(QUANTILES, qs):
            st[f"q{int(round(q * 100)):02d}"] = val
        out[k] = st
    return out


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """A camera's episode stats in lerobot's layout, from uint8 [L, H, W, C] frames: the
    frames lerobot samples (downsampled as its ``auto_downsample_height_width`` does), per
    channel, divided by 255; quantiles from the exact value histogram."""
    x = frames[_sample_indices(len(frames))]
    h, w = x.shape[1:3]
    if max(h, w) >= 300:
        f = int(w / 150) if w > h else int(h / 150)
        x = x[:, ::f, ::f]
    c = x.shape[-1]
    vals = np.arange(256, dtype=np.float64)
    out: dict[str, list] = {k: [] for k in ("min", "max", "mean", "std", *(f"q{int(round(q * 100)):02d}" for q in QUANTILES))}
    for ch in range(c):
        hist = np.bincount(np.ascontiguousarray(x[..., ch]).reshape(-1), minlength=256).astype(np.float64)
        total = hist.sum()
        nz = np.flatnonzero(hist)
        lo, hi = float(nz[0]), float(nz[-1])
        mean = float(hist @ vals) / total
        var = float(hist @ (vals * vals)) / total - mean * mean
        out["min"].append(lo)
        out["max"].append(hi)
        out["mean"].append(mean)
        out["std"].append(np.sqrt(max(0.0, var)))
        edges = np.clip(np.arange(257) - 0.5, lo, hi)  # value v spans [v - 0.5, v + 0.5]
        cdf = np.concatenate([[0.0], np.cumsum(hist) / total])
        for q in QUANTILES:
            out[f"q{int(round(q * 100)):02d}"].append(float(np.interp(q, cdf, edges)))
    stats = {k: (np.array(v, np.float64 if k.startswith("q") else np.float32) / 255.0)
             .astype(np.float64 if k.startswith("q") else np.float32).reshape(c, 1, 1)
             for k, v in out.items()}
    stats["count"] = np.array([len(x)], dtype=np.int64)
    return stats


def encode_video(frames: np.ndarray, path: str, fps: int, vcodec: str, pix_fmt: str,
                 options: dict[str, str]) -> None:
    """Encode uint8 [L, H, W, 3] frames as lerobot's ``encode_video_frames`` does (same
    stream settings and codec options), from memory."""
    import av

    with av.open(path, "w") as out:
        stream = out.add_stream(vcodec, fps, options=options)
        stream.pix_fmt = pix_fmt
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        for f in frames:
            packet = stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24"))
            if packet:
                out.mux(packet)
        packet = stream.encode()
        if packet:
            out.mux(packet)


def prepare_episode(job: PrepareJob) -> Prepared:
    """The worker's job (also callable in-process): staged videos and camera stats."""
    prep = Prepared()
    t0 = time.process_time()
    ep = job.episode
    cols = episode_table_columns(ep, job.spec, job.features, job.fps, first_index=0,
                                 episode_index=0, task_index=np.zeros(len(ep), np.int64))
    prep.stats = column_stats({k: v for k, v in cols.items() if k not in COMMIT_COLUMNS})
    try:
        for k in (k for k, ft in job.features.items() if ft["dtype"] == "video"):
            frames = ep.arrays[k]
            want = tuple(job.features[k]["shape"])
            if frames.dtype != np.uint8 or tuple(frames.shape) != (len(ep), *want):
                raise ValueError(f"episode {ep.episode} of actor {ep.actor_id}: {k!r} frames are "
                                 f"{frames.dtype}{list(frames.shape)}, the dataset stores uint8"
                                 f"{[len(ep), *want]}")
            prep.stats[k] = image_stats(frames)
            d = tempfile.mkdtemp(dir=job.staging)
            prep.videos[k] = os.path.join(d, f"{k}.mp4")
            encode_video(frames, prep.videos[k], job.fps, job.vcodec, job.pix_fmt, job.options)
    except BaseException:
        prep.discard()
        raise
    prep.cpu_s = time.process_time() - t0
    return prep


def _worker_init() -> None:  # pragma: no cover - runs in the worker processes
    os.environ.setdefault("SVT_LOG", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import av

        av.logging.set_level(av.logging.ERROR)
    except Exception:
        pass


def _discard_result(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().discard()


class PreparePool:
    """Episodes prepared ahead in ``workers`` processes (spawned: the learner's threads and
    CUDA state are not forked), keyed by (actor, episode); ``workers=0`` prepares in the
    calling thread at commit time (tests, tools).

    The processes start on the first submitted episode. Until one of them has finished a job
    (start-up takes a second or so, longer on a loaded machine), the writer thread prepares
    the episodes it commits itself rather than wait. ``counts``: episodes prepared by the
    pool (``pool``) and by the writer thread (``inline``).
    """

    def __init__(self, root: Path, *, workers: int, make_job):
        self.staging = Path(root) / STAGING
        shutil.rmtree(self.staging, ignore_errors=True)  # nothing staged is ever committed
        self.staging.mkdir(parents=True, exist_ok=True)
        self.workers = max(0, int(workers))
        self._make_job = make_job
        self._lock = threading.Lock()
        self._futures: dict[tuple[str, int], Future] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._warm = False
        self.counts: Counter[str] = Counter()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing as mp

            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_worker_init)
        return self._pool

    def submit(self, ep: Episode) -> None:
        """Start preparing ``ep`` (no-op without workers)."""
        if self.workers == 0:
            return
        with self._lock:
            if ep.key in self._futures:
                return
            job = self._make_job(ep)
            try:
                fut = self._executor().submit(prepare_episode, job)
            except (BrokenProcessPool, RuntimeError) as exc:  # a worker died: start a new pool
                log.warning("episode store: encoder pool restarted (%s)", exc)
                self._pool = None
                fut = self._executor().submit(prepare_episode, job)
            fut.add_done_callback(self._done)
            self._futures[ep.key] = fut

    def _done(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._warm = True

    def take(self, ep: Episode) -> Prepared:
        """The prepared episode (waiting for it); prepared again, here, if its worker failed
        for a reason of its own or a rolled-back commit used up its videos. Errors of the
        episode itself (bad arrays, disk full) are raised."""
        with self._lock:
            fut = self._futures.pop(ep.key, None)
        if fut is not None and (self._warm or fut.done() or not fut.cancel()):
            try:
                prep = fut.result()
                if prep.videos_present():
                    self.counts["pool"] += 1
                    return prep
                prep.discard()
            except BrokenProcessPool as exc:
                log.warning("episode store: an encoder process died (%s); encoding episode %d of "
                            "actor %s in the writer thread", exc, ep.episode, ep.actor_id)
                with self._lock:
                    self._pool = None
        self.counts["inline"] += 1
        return prepare_episode(self._make_job(ep))

    def forget(self, ep: Episode) -> None:
        """Drop what was prepared for an episode that will not be written."""
        with self._lock:
            fut = self._futures.pop(ep.key, None)
        if fut is not None and not fut.cancel():
            fut.add_done_callback(_discard_result)

    def close(self) -> None:
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            pool, self._pool = self._pool, None
        for f in futures:
            f.cancel()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
