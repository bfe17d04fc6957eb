"""The commit half of a pool-prepared episode write (:mod:`data.store.prepare`): what
lerobot 0.6's ``DatasetWriter.save_episode`` does once an episode's stats and videos exist,
on lerobot's own writer and metadata objects (:class:`Appender`, one per commit).

For each episode it builds the parquet rows as one Arrow table with lerobot's schema
straight from the record arrays (each column's shape checked against its feature, as
lerobot's ``validate_frame`` does), numbers them (``index``, ``episode_index``,
``task_index``) and their stats, appends them to the writer's parquet file (a new file where
lerobot would start one), and records the episode with ``meta.save_episode`` (episode
metadata, info.json, aggregated stats). At the end of the commit the staged videos go into
lerobot's video files. ``LeRobotDataset`` and every lerobot tool load the result (tested);
the writer internals used here are checked by :func:`check_append_internals`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.core.spec import EnvSpec
from data.store.compat import quiet_av
from data.store.episode import Episode
from data.store.features import StoreError
from data.store.prepare import Prepared, column_stats, episode_table_columns


def check_append_internals(ds) -> None:
    """Fail loudly if the lerobot writer attributes used here have moved."""
    w, m = ds.writer, ds.meta
    missing = [name for obj, name in (
        (w, "_pq_writer"), (w, "_latest_episode"), (w, "_current_file_start_frame"),
        (w, "_recorded_frames"), (w, "close_writer"),
        (w, "_create_episode_buffer"), (m, "save_episode"), (m, "save_episode_tasks"),
        (m, "get_task_index"), (m, "chunks_size"), (m, "data_files_size_in_mb"),
        (m, "data_path"), (m, "video_keys"), (m, "video_path"),
        (m, "video_files_size_in_mb"), (m, "update_video_info")) if not hasattr(obj, name)]
    if missing:  # pragma: no cover - depends on the lerobot version
        import lerobot

        raise StoreError(f"lerobot {lerobot.__version__}: dataset writer lacks {missing}; the "
                         "pool encoder supports lerobot 0.6 (set buffer.encoder=lerobot)")


def _data_file(ds, n: int) -> tuple[int, int, int]:
    """(chunk, file, first global frame index) of the parquet file the episode's rows go to,
    chosen as lerobot's ``_save_episode_data`` chooses it (closing a full file)."""
    from lerobot.datasets.io_utils import get_file_size_in_mb
    from lerobot.datasets.utils import update_chunk_file_indices

    w, meta = ds.writer, ds.meta
    latest = w._latest_episode
    if latest is None:
        chunk, file, first = 0, 0, 0
        w._current_file_start_frame = 0
        if meta.episodes is not None and len(meta.episodes) > 0:
            last = meta.episodes[-1]
            first = int(last["dataset_to_index"])
            chunk, file = update_chunk_file_indices(int(last["data/chunk_index"]),
                                                    int(last["data/file_index"]), meta.chunks_size)
            w._current_file_start_frame = first
        return chunk, file, first
    chunk, file = int(latest["data/chunk_index"]), int(latest["data/file_index"])
    first = int(latest["index"][-1]) + 1
    path = ds.root / meta.data_path.format(chunk_index=chunk, file_index=file)
    size_mb = get_file_size_in_mb(path)
    in_file = first - w._current_file_start_frame
    per_frame = size_mb / in_file if in_file > 0 else 0
    if size_mb + per_frame * n >= meta.data_files_size_in_mb:
        chunk, file = update_chunk_file_indices(chunk, file, meta.chunks_size)
        w.close_writer()
        w._current_file_start_frame = first
    return chunk, file, first


def arrow_table(cols: dict[str, np.ndarray], features: dict):
    """The columns as the Arrow table lerobot writes (its ``datasets`` schema and metadata)."""
    import pyarrow as pa
    from datasets.arrow_writer import TypedSequence
    from lerobot.datasets.feature_utils import get_hf_features_from_features

    hf = get_hf_features_from_features(features)
    schema = hf.arrow_schema
    arrays = []
    for (k, ft), field in zip(hf.items(), schema):
        v = cols[k]
        if v.dtype == object:
            a = pa.array(v.tolist(), type=pa.string())
        elif v.ndim == 2 and pa.types.is_fixed_size_list(field.type):  # no per-row conversion
            a = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(v).reshape(-1)),
                                                  v.shape[1])
        elif v.ndim == 1:
            a = pa.array(v)
        else:
            a = pa.array(TypedSequence(v, type=ft))
        arrays.append(a if a.type == field.type else a.cast(field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


class Appender:
    """One commit's worth of pool-prepared episodes appended to lerobot's open writer.

    Rows and metadata go in episode by episode (:meth:`add`), as lerobot's ``save_episode``
    writes them; the staged videos of the commit are placed by :meth:`finish`, each camera's
    episodes joined into lerobot's video file with one ``concatenate_video_files`` call
    (lerobot's ``_save_episode_video`` re-muxes the growing file once per episode). Episode
    ``from_timestamp`` / ``to_timestamp`` and the file choice follow lerobot's rules (a new
    file per commit, since the writer is sealed between commits; a new file when the next
    episode would take it past ``video_files_size_in_mb``).
    """

    def __init__(self, ds, spec: EnvSpec, fps: int, encoder):
        self.ds, self.spec, self.fps, self.encoder = ds, spec, fps, encoder
        self._groups: dict[str, list[dict]] = {k: [] for k in ds.meta.video_keys}
        self._first_episode = int(ds.meta.total_episodes)

    def _place_video(self, key: str, ep_index: int, staged: str) -> dict:
        from lerobot.datasets.io_utils import get_file_size_in_mb
        from lerobot.datasets.utils import update_chunk_file_indices
        from lerobot.datasets.video_utils import get_video_duration_in_s

        meta = self.ds.meta
        groups = self._groups[key]
        size = get_file_size_in_mb(Path(staged))
        duration = get_video_duration_in_s(staged)
        g = groups[-1] if groups else None
        if g is None or g["size"] + size >= meta.video_files_size_in_mb:
            if g is not None:
                chunk, file = update_chunk_file_indices(g["chunk"], g["file"], meta.chunks_size)
            elif meta.episodes is not None and len(meta.episodes) > 0 and \
                    f"videos/{key}/chunk_index" in meta.episodes[-1]:
                last = meta.episodes[-1]
                chunk, file = update_chunk_file_indices(int(last[f"videos/{key}/chunk_index"]),
                                                        int(last[f"videos/{key}/file_index"]),
                                                        meta.chunks_size)
            else:
                chunk, file = 0, 0
            g = {"chunk": chunk, "file": file, "size": 0.0, "duration": 0.0, "parts": []}
            groups.append(g)
        start = g["duration"]
        g["parts"].append(staged)
        g["size"] += size
        g["duration"] += duration
        return {f"videos/{key}/chunk_index": g["chunk"], f"videos/{key}/file_index": g["file"],
                f"videos/{key}/from_timestamp": start,
                f"videos/{key}/to_timestamp": start + duration}

    def add(self, ep: Episode, prep: Prepared) -> None:
        """Append one episode's rows and metadata (its videos are placed by :meth:`finish`)."""
        import pyarrow.parquet as pq

        w, meta = self.ds.writer, self.ds.meta
        n = len(ep)
        ep_index = int(meta.total_episodes)
        episode_tasks = list(dict.fromkeys(ep.tasks))
        meta.save_episode_tasks(episode_tasks)
        task_index = np.array([meta.get_task_index(t) for t in ep.tasks], np.int64)
        cols = episode_table_columns(ep, self.spec, meta.features, self.fps,
                                     first_index=int(meta.total_frames), episode_index=ep_index,
                                     task_index=task_index)
        stats = dict(prep.stats)
        stats.update(column_stats({k: cols[k] for k in ("index", "episode_index", "task_index")}))
        table = arrow_table(cols, meta.features)
        chunk, file, first = _data_file(self.ds, n)
        path = self.ds.root / meta.data_path.format(chunk_index=chunk, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not w._pq_writer:
            w._pq_writer = pq.ParquetWriter(path, schema=table.schema, compression="snappy",
                                            use_dictionary=True)
        w._pq_writer.write_table(table)
        metadata = {"data/chunk_index": chunk, "data/file_index": file,
                    "dataset_from_index": first, "dataset_to_index": first + n}
        w._latest_episode = {"index": cols["index"], **metadata}
        w._recorded_frames += n
        for key in meta.video_keys:
            metadata.update(self._place_video(key, ep_index, prep.videos[key]))
        meta.save_episode(ep_index, n, episode_tasks, stats, metadata)
        w.episode_buffer = w._create_episode_buffer()

    def discard(self) -> None:
        """Delete the staged videos not yet placed (the commit is being rolled back)."""
        import shutil

        for groups in self._groups.values():
            for g in groups:
                for p in g["parts"]:
                    shutil.rmtree(Path(p).parent, ignore_errors=True)

    def finish(self) -> None:
        """Write the commit's video files (moved, or joined without re-encoding)."""
        import shutil

        from lerobot.datasets.io_utils import write_info
        from lerobot.datasets.video_utils import concatenate_video_files

        meta = self.ds.meta
        for key, groups in self._groups.items():
            for g in groups:
                out = self.ds.root / meta.video_path.format(video_key=key, chunk_index=g["chunk"],
                                                            file_index=g["file"])
                out.parent.mkdir(parents=True, exist_ok=True)
                if len(g["parts"]) == 1:
                    shutil.move(g["parts"][0], out)
                else:
                    concatenate_video_files([Path(p) for p in g["parts"]], out)
                for p in g["parts"]:
                    shutil.rmtree(Path(p).parent, ignore_errors=True)
            if groups and self._first_episode == 0:
                meta.update_video_info(key, video_encoder=self.encoder)
        if self._first_episode == 0 and any(self._groups.values()):
            write_info(meta.info, meta.root)
            quiet_av()  # lerobot's get_video_info turned FFmpeg's own logging back on
