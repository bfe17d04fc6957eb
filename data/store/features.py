"""The dataset layout: where lerobot keeps its files, and how a Tandem record maps to the
frame features of the LeRobot dataset (both ways). The table is in :mod:`data.store`."""

from __future__ import annotations

import numpy as np

from data.core.schema import EXTRA_PREFIX, OBS_IMAGE_PREFIX, OBS_STATE, STEP_ARRAYS, STEP_DEFAULTS
from data.core.spec import EnvSpec

DEFAULT_REPO_ID = "tandem/replay"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"

#: record key -> (frame feature, dtype); scalars are stored with shape (1,), lerobot's convention
SCALAR_FEATURES: dict[str, tuple[str, str]] = {
    "reward": ("next.reward", "float32"),
    "terminated": ("next.terminated", "bool"),
    "truncated": ("next.truncated", "bool"),
    "success": ("next.success", "bool"),
    "intervened": ("intervened", "bool"),
    "is_last": ("is_last", "bool"),
    "policy_version": ("policy_version", "int64"),
    "episode": ("actor_episode", "int64"),
    "chunk_start": ("chunk_start", STEP_ARRAYS["chunk_start"]),
    "chunk_index": ("chunk_index", STEP_ARRAYS["chunk_index"]),
    "group_id": ("group_id", STEP_ARRAYS["group_id"]),
}

#: columns lerobot adds to every frame by itself
LEROBOT_COLUMNS = frozenset({"timestamp", "frame_index", "episode_index", "index", "task_index"})


class StoreError(RuntimeError):
    """The dataset on disk cannot be used (not Tandem's, another env spec, corrupted)."""


def extra_shape(shape) -> tuple[int, ...]:
    """A policy extra's feature shape: its record shape, a scalar () stored as (1,)."""
    shape = tuple(int(d) for d in shape)
    return shape if shape else (1,)


def build_features(spec: EnvSpec, *, video: bool = True) -> dict[str, dict]:
    """LeRobot feature dict for an env spec (see the table in :mod:`data.store`)."""
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
    for name, (dt, shape) in sorted(spec.extras.items()):
        feats[EXTRA_PREFIX + name] = {"dtype": dt, "shape": extra_shape(shape), "names": None}
    return feats


def features_diff(on_disk: dict, wanted: dict) -> str | None:
    """Every difference that matters between a dataset's features and the ones this run
    needs, named in one line; None when they match."""
    missing, changed = [], []
    for k, ft in wanted.items():
        got = on_disk.get(k)
        if got is None:
            missing.append(k)
        elif got["dtype"] != ft["dtype"] or list(got["shape"]) != list(ft["shape"]):
            changed.append(f"{k!r} is {got['dtype']}{list(got['shape'])}, this run needs "
                           f"{ft['dtype']}{list(ft['shape'])}")
    unexpected = sorted(set(on_disk) - set(wanted) - LEROBOT_COLUMNS)
    parts = []
    if missing:
        parts.append(f"features {sorted(missing)} missing")
    if unexpected:
        parts.append(f"unexpected features {unexpected}")
    parts.extend(f"feature {c}" for c in changed)
    return "; ".join(parts) or None


def episode_problem(arrays: dict[str, np.ndarray], n: int, spec: EnvSpec) -> str | None:
    """Why an episode's arrays cannot become frames of this spec's dataset, or None. (The
    columns of :data:`STEP_DEFAULTS` may be missing: they take their defaults.)"""
    for k in (OBS_STATE, "action", *spec.image_keys,
              *(k for k in SCALAR_FEATURES if k not in STEP_DEFAULTS)):
        if k not in arrays:
            return f"no {k!r} array"
        if len(arrays[k]) != n:
            return f"{k!r} has {len(arrays[k])} rows, the episode {n}"
    for name, (dt, shape) in spec.extras.items():
        k = EXTRA_PREFIX + name
        arr = arrays.get(k)
        if arr is None:
            return f"no {k!r} array (the policy declares extra {name!r} {dt}{list(shape)})"
        if tuple(arr.shape) != (n, *shape):
            return f"{k!r} has shape {tuple(arr.shape)}, expected {(n, *shape)}"
    return None


def episode_frames(arrays: dict[str, np.ndarray], n: int, spec: EnvSpec) -> list[dict]:
    """The frame dicts (without actor id, seq and task) of an episode's records."""
    cols = episode_columns(arrays, n, spec)
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def episode_columns(arrays: dict[str, np.ndarray], n: int, spec: EnvSpec) -> dict[str, np.ndarray]:
    """The frame features of an episode's records as columns [n, *feature shape] (without
    actor id, seq and task; cameras as given, uint8 [n, H, W, 3])."""
    cols: dict[str, np.ndarray] = {
        OBS_STATE: np.asarray(arrays[OBS_STATE], np.float32),
        "action": np.asarray(arrays["action"], np.float32),
    }
    for k in spec.image_keys:
        cols[k] = arrays[k]
    for key, (name, dt) in SCALAR_FEATURES.items():
        src = arrays[key] if key in arrays else np.full(n, STEP_DEFAULTS[key])
        cols[name] = np.asarray(src, dtype=dt).reshape(n, 1)
    for name, (dt, shape) in spec.extras.items():
        k = EXTRA_PREFIX + name
        cols[k] = np.asarray(arrays[k], dtype=dt).reshape(n, *extra_shape(shape))
    return cols


def record_arrays(columns: dict[str, np.ndarray], n: int, spec: EnvSpec) -> dict[str, np.ndarray]:
    """Frame columns of a Tandem-written episode (scalars squeezed to [n]) back into record
    arrays (without images). Columns written before a record column existed take its
    default; extras the dataset does not hold (demos) are left out."""
    c = columns
    arrays: dict[str, np.ndarray] = {
        OBS_STATE: np.ascontiguousarray(c[OBS_STATE], np.float32).reshape(n, spec.state_dim),
        "action": np.ascontiguousarray(c["action"], np.float32).reshape(n, spec.action_dim),
        "step": np.asarray(c["frame_index"]).astype(np.int64),
    }
    for key, (name, dt) in SCALAR_FEATURES.items():
        if name in c:
            arrays[key] = np.asarray(c[name]).reshape(n).astype(dt)
        elif key in STEP_DEFAULTS:
            arrays[key] = np.full(n, STEP_DEFAULTS[key], dtype=dt)
        else:
            raise KeyError(f"dataset episode has no {name!r} column")
    for name, (dt, shape) in spec.extras.items():
        k = EXTRA_PREFIX + name
        if k in c:
            arrays[k] = np.ascontiguousarray(np.asarray(c[k]).reshape(n, *shape), dtype=dt)
    return arrays
