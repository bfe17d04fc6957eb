"""Reading any local LeRobot v3.0 dataset (Tandem's or not) with pyarrow, decoding each
video file once, sequentially, with PyAV (no per-frame seeking); and turning an episode of
a Tandem-written dataset back into a transition batch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from data.core.spec import EnvSpec
from data.store.features import INFO_PATH, TASKS_PATH, record_arrays
from data.core.transitions import TransitionBatch


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
                  max_frames: int | None = None, columns: Sequence[str] | None = None,
                  progress: str | None = None) -> Iterator[DatasetEpisode]:
    """Yield episodes of a local LeRobot v3.0 dataset in episode order, with camera frames
    decoded (each video file decoded once, sequentially). ``max_frames`` keeps the newest
    episodes whose lengths add up to at most that many frames (at least one episode);
    ``columns`` restricts the non-camera columns read. ``progress``: the label of a tqdm bar
    (episodes done / total) on stderr, shown only when stderr is a terminal."""
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
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sel), desc=progress, unit="ep", disable=None, leave=False)
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
            if bar is not None:
                bar.update(1)
            yield DatasetEpisode(e, cols, images, ep_tasks, info)
    finally:
        if bar is not None:
            bar.close()
        for cur in cursors.values():
            cur.close()


def _column_to_numpy(col) -> np.ndarray:
    """A pyarrow column as numpy: list columns become [N, D] (or deeper), strings object."""
    import pyarrow as pa

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(col, pa.ExtensionArray):  # datasets' Array2D..5D: nested lists underneath
        col = col.storage
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
    """A Tandem-written dataset episode back into a transition batch (records in order),
    with the spec's policy extras (``extra.<name>``, the spec's dtype and shape) where the
    dataset holds them."""
    c = ep.columns
    n = len(ep)
    arrays = record_arrays(c, n, spec)
    for k in spec.image_keys:
        arrays[k] = ep.images[k]
    actor = str(c["actor_id"][0]) if n else ""
    seqs = c["actor_seq"].astype(np.int64)
    return TransitionBatch(actor, int(seqs[0]) if n else 0, arrays, list(ep.tasks))
