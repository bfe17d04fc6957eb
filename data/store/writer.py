"""EpisodeStore: appends finished episodes to a LeRobot dataset, one durable commit at a
time (durability and recovery are described in :mod:`data.store`).

Two encoders write video datasets (``buffer.encoder``):

- ``pool`` (default): each submitted episode is prepared at once in worker processes --
  stats and one H.264 MP4 per camera (preset ``veryfast``, CRF 23, lerobot's GOP of 2)
  encoded from memory -- and the writer thread only appends rows, metadata and videos at
  commit time (:mod:`data.store.prepare`, :mod:`data.store.append`). H.264 files are larger
  than AV1's at a higher PSNR; ``python -m tools.bench.buffer --json`` compares the two
  encoders (current figures: docs/benchmarks.md, "The replay buffer and the dataset writer").
- ``lerobot``: lerobot's own ``add_frame`` / ``save_episode`` on the writer thread (PNG
  staging of every frame, then AV1 through SVT-AV1), the method before the pool.

Image datasets (``video=False`` with cameras: PNGs in the parquet rows) always use lerobot's
path. A dataset without cameras uses the pool's path whatever ``video`` says, its stats
computed on the writer thread (no worker processes): lerobot's ``save_episode`` runs a per-row
``datasets.map`` that embeds images even where there are none, slower than a few actors make
state-only episodes, so the episodes waiting for it (in the learner's memory) and their
unacknowledged records (in the actors' spool caches) would grow without bound.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from data.core.spec import EnvSpec
from data.fsutil import free_mb, is_disk_full
from data.store import commit as cm
from data.store.compat import (DISK_FULL_SEEN, abandon_writer, check_writer_internals,
                               import_lerobot, quiet_av, seal_writer)
from data.store.append import Appender, check_append_internals
from data.store.episode import Episode
from data.store.features import (DEFAULT_REPO_ID, INFO_PATH, StoreError, build_features,
                                 episode_frames, episode_problem)
from data.store.reader import read_episodes, tandem_batch
from data.store.prepare import PreparePool, PrepareJob
from data.store.worker import CommitWorker

log = logging.getLogger("tandem.data.store")

ENCODERS = ("pool", "lerobot")
#: lerobot encoder settings per codec where Tandem's differ from lerobot's defaults
CODEC_SETTINGS = {"h264": {"preset": "veryfast", "crf": 23}}


class EpisodeStore(CommitWorker):
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
        encoder: str = "pool",
        encode_workers: int = 2,
        commit_interval_s: float = 0.0,
        max_episodes_per_commit: int = 32,
        retry_min_s: float = 1.0,
        retry_max_s: float = 60.0,
        fsync: bool = True,
    ):
        self.root = Path(root)
        super().__init__(label=str(self.root), commit_interval_s=commit_interval_s,
                         max_episodes_per_commit=max_episodes_per_commit,
                         retry_min_s=retry_min_s, retry_max_s=retry_max_s)
        self.spec = spec
        self.fps = int(fps)
        self.video = bool(video)
        self.repo_id = repo_id
        if encoder not in ENCODERS:
            raise ValueError(f"buffer.encoder must be one of {ENCODERS}, got {encoder!r}")
        self.encoder = encoder
        self.vcodec = vcodec or ("h264" if encoder == "pool" else "libsvtav1")
        self.fsync = fsync
        self.features = build_features(spec, video=self.video)
        if self.video and self.vcodec == "libsvtav1":
            small = {c: s for c, s in spec.cameras.items() if min(s[0], s[1]) < 32}
            if small:  # SVT-AV1 kills the process (SIGFPE) on tiny frames
                raise StoreError(f"cameras {small} are smaller than 32x32: too small to store as "
                                 "AV1 video; set buffer.video=false (PNG images) or another vcodec")
        if self.video and self.vcodec in ("h264", "hevc"):
            odd = {c: s for c, s in spec.cameras.items() if s[0] % 2 or s[1] % 2}
            if odd:
                raise StoreError(f"cameras {odd} have an odd height or width: {self.vcodec} "
                                 "(yuv420p) needs even sizes; set buffer.video=false (PNG images)")
        self.ack_preview: Callable[[list[Episode]], dict[str, int]] | None = None
        self.acked: dict[str, int] = {}
        self.max_episode: dict[str, int] = {}
        self.total_episodes = 0
        self.total_frames = 0
        self._commit_no = 0
        self._last_files: cm.Files = {}
        self._ds = None  # LeRobotDataset in write mode, sealed between commits
        self._failures: Counter[tuple[str, int]] = Counter()
        self._needs_recover = False
        self.recovered_files = 0  # files of an unfinished commit removed by the last recover()
        self._LeRobotDataset = import_lerobot()
        self._kinds = cm.file_kinds(self.root, spec.image_keys, self.video)
        self._rgb_encoder = self._make_encoder() if self.video else None
        self._pool: PreparePool | None = None
        self._appender: Appender | None = None
        self._open()
        appends = encoder == "pool" and (self.video or not spec.cameras)
        self._pool = (PreparePool(self.root, workers=encode_workers if spec.cameras else 0,
                                  make_job=self._job) if appends else None)

    # ---- opening, recovery, commits ------------------------------------------------------

    @property
    def commit_path(self) -> Path:
        return cm.commit_path(self.root)

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
                    f"{cm.COMMIT_DIR}/{cm.COMMIT_FILE}); use another buffer.dataset_dir, or load "
                    "it as demonstrations (buffer.demos)")
            log.warning("%s: removing an unfinished dataset creation", self.root)
            shutil.rmtree(self.root)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self._ds = self._LeRobotDataset.create(
            self.repo_id, fps=self.fps, features=self.features, root=self.root,
            use_videos=self.video, video_backend="pyav", **self._encoder_kwargs())
        self._write_commit({}, {})
        log.info("episode store: created LeRobot dataset %s (%s)", self.root,
                 "video" if self.video else "images")

    def _make_encoder(self):
        from lerobot.configs import RGBEncoderConfig

        return RGBEncoderConfig(vcodec=self.vcodec, **CODEC_SETTINGS.get(self.vcodec, {}))

    def _encoder_kwargs(self) -> dict:
        return {"rgb_encoder": self._rgb_encoder} if self._rgb_encoder is not None else {}

    def _job(self, ep: Episode) -> PrepareJob:
        enc = self._rgb_encoder  # None: no cameras, nothing to encode
        return PrepareJob(ep, self.spec, self._lr_features, self.fps, str(self._pool.staging),
                          enc.vcodec if enc else "", enc.pix_fmt if enc else "",
                          enc.get_codec_options(1, as_strings=True) if enc else {})

    @property
    def prepared(self) -> dict[str, int]:
        """Episodes whose cameras were prepared by the encoder pool (``pool``) and by the
        writer thread itself (``inline``: before the pool's first result, or a retry)."""
        return dict(self._pool.counts) if self._pool is not None else {}

    def _prepare(self, episode: Episode) -> None:
        if self._pool is not None and episode_problem(episode.arrays, len(episode), self.spec) is None:
            self._pool.submit(episode)

    def recover(self) -> None:
        """Bring the directory back to the last commit (see :mod:`data.store`). A dataset
        whose features differ from this run's raises StoreError before anything is touched."""
        rec = cm.read_commit(self.root, self.features)
        self.recovered_files = cm.recover(self.root, rec, self._kinds, fsync=self.fsync)
        self._apply_record(rec)
        self._ds = None

    def _apply_record(self, rec: dict) -> None:
        self._commit_no = int(rec["commit"])
        self.total_episodes = int(rec["total_episodes"])
        self.total_frames = int(rec["total_frames"])
        self._last_files = dict(rec["last_files"])
        self.acked = {k: int(v) for k, v in rec.get("acked", {}).items()}
        self.max_episode = {k: int(v) for k, v in rec.get("max_episode", {}).items()}
        self._lr_features = {k: {**ft, "shape": tuple(ft["shape"])}
                             for k, ft in rec["info"]["features"].items()}

    def _write_commit(self, acked: dict[str, int], max_episode: dict[str, int]) -> None:
        acked_all = {**self.acked, **{k: int(v) for k, v in acked.items()}}
        max_ep = dict(self.max_episode)
        for k, v in max_episode.items():
            max_ep[k] = max(int(v), max_ep.get(k, -1))
        rec = cm.make_record(self.root, self._ds.meta, self._kinds, commit=self._commit_no + 1,
                             acked=acked_all, max_episode=max_ep)
        cm.write_record(self.root, rec)
        self._apply_record(rec)

    def _ensure_writer(self):
        if self._ds is None:
            self._ds = self._LeRobotDataset.resume(
                self.repo_id, root=self.root, video_backend="pyav", **self._encoder_kwargs())
            check_writer_internals(self._ds)
            if self._pool is not None:
                check_append_internals(self._ds)
        return self._ds

    def _abandon_writer(self) -> None:
        ds, self._ds = self._ds, None
        abandon_writer(ds)

    def _closed(self) -> None:
        self._abandon_writer()
        if self._pool is not None:
            self._pool.close()

    def _write_episode(self, ep: Episode) -> None:
        ds = self._ensure_writer()
        import datasets

        datasets.disable_progress_bars()  # lerobot's metadata loading turns them back on
        if self._pool is not None:
            if self._appender is None:
                self._appender = Appender(ds, self.spec, self.fps, self._rgb_encoder)
            self._appender.add(ep, self._pool.take(ep))
            return
        n = len(ep)
        seqs = np.asarray(ep.seqs, np.int64)
        for i, frame in enumerate(episode_frames(ep.arrays, n, self.spec)):
            frame["actor_id"] = ep.actor_id
            frame["actor_seq"] = seqs[i : i + 1]
            frame["task"] = ep.tasks[i]
            ds.add_frame(frame)
        ds.save_episode(parallel_encoding=False)

    def _settle(self, episodes: Sequence[Episode]) -> tuple[list[Episode], list[Episode]]:
        """Split off the episodes that can never be written: lerobot refused them three
        times, or their arrays do not fit the dataset (a missing policy extra, ...)."""
        done: list[Episode] = []
        dropped: list[Episode] = []
        for ep in episodes:
            why = episode_problem(ep.arrays, len(ep), self.spec)
            if why is None and self._failures[ep.key] >= 3:
                why = f"lerobot refused it {self._failures[ep.key]} times"
            if why is None:
                done.append(ep)
                continue
            log.error("episode store: dropping episode %d of actor %s: %s", ep.episode,
                      ep.actor_id, why)
            if self._pool is not None:
                self._pool.forget(ep)
            dropped.append(ep)
            self.counters["dropped_episodes"] += 1
        return done, dropped

    def write(self, episodes: Sequence[Episode]) -> tuple[list[Episode], list[Episode]]:
        """Write ``episodes`` as one commit (synchronously, on the caller's thread; the writer
        thread calls this). Returns (durable, dropped): an episode that does not fit the
        dataset, or whose frames lerobot refused three times, is dropped with a logged reason.
        Raises after rolling the commit back (disk full, I/O error, ...): nothing of it stays
        on disk."""
        if self._needs_recover:  # an earlier rollback did not finish
            self.recover()
            self._needs_recover = False
        quiet_av()
        before = dict(self._last_files)
        seen = DISK_FULL_SEEN.seen
        done, dropped = self._settle(episodes)
        try:
            for ep in done:
                try:
                    self._write_episode(ep)
                except Exception as exc:
                    if DISK_FULL_SEEN.seen > seen and not is_disk_full(exc):
                        raise OSError(errno.ENOSPC, f"No space left on device (lerobot's image "
                                      f"writer; then: {exc})") from exc
                    if not is_disk_full(exc):
                        self._failures[ep.key] += 1
                    raise
            if self._appender is not None:
                self._appender.finish()
            if self._ds is not None:
                seal_writer(self._ds)
            else:
                self._ensure_writer()
            if self.fsync:
                cm.fsync_new_files(self.root, self._kinds, before)
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
            if self._appender is not None:
                self._appender.discard()
            self._rollback()
            raise
        finally:
            self._appender = None
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

    def _report_failure(self, exc: Exception, n: int, retry_s: float) -> None:
        self.counters["write_errors"] += 1
        what = is_disk_full(exc)
        if what:
            msg = (f"{what} writing episodes to {self.root} ({free_mb(self.root):.1f} MB free): "
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
        for ep in read_episodes(self.root, max_frames=cap, progress="refilling the buffer from the dataset"):
            batch = tandem_batch(ep, self.spec)
            buffer.add(batch, restored=True)
            added += len(batch)
        log.info("episode store: refilled the buffer with %d records (%d transitions) from %s "
                 "in %.1fs", added, len(buffer), self.root, time.monotonic() - t0)
        return added
