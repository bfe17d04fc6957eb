"""Any local LeRobot v3.0 dataset as a demo replay buffer.

Frames become records of :mod:`data.core.schema`; each episode's frames are transitions to the
following frame. The columns are mapped as follows (first one present wins):

=================== ===================================================== ================
record key          dataset column(s)                                     if absent
=================== ===================================================== ================
observation.state   observation.state                                     (required)
observation.images  observation.images.<cam> (video or image, [H, W, 3])   (required, per
                                                                           camera of the spec)
action              action                                                (required)
reward              next.reward, reward                                   0
terminated          next.terminated, next.done, terminated, done          see below
truncated           next.truncated, truncated                             False
success             next.success, success                                 see below
intervened          intervened, complementary_info.is_intervention        False
policy_version      policy_version                                        -1 (a demo)
task                the LeRobot task                                      ""
=================== ===================================================== ================

Datasets written by Tandem carry their own final ``is_last`` frames and are read back
exactly. For other datasets the final observation after the last frame is not recorded:
the last frame becomes a transition onto itself, marked terminated when the dataset has no
termination column and ``episode_end="terminated"`` (the default: demonstrations end when
the task is done; a terminated transition never bootstraps, so its next observation is
never used), or truncated with ``episode_end="truncated"``. Episodes are successful unless
the dataset says otherwise.

Camera frames are decoded once, here (:func:`data.store.read_episodes`).
``keys`` renames dataset columns to Tandem's, e.g. ``{"observation.images.top":
"observation.images.front"}``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from data.store import DatasetEpisode, read_episode_table, read_episodes, read_info
from data.replay import ReplayBuffer
from data.core.schema import OBS_STATE
from data.core.transitions import TransitionBatch
from data.core.spec import EnvSpec

log = logging.getLogger("tandem.data.demos")

_ALIASES = {
    "reward": ("next.reward", "reward"),
    "terminated": ("next.terminated", "next.done", "terminated", "done"),
    "truncated": ("next.truncated", "truncated"),
    "success": ("next.success", "success"),
    "intervened": ("intervened", "complementary_info.is_intervention"),
    "policy_version": ("policy_version",),
}


def _col(ep: DatasetEpisode, key: str):
    for name in _ALIASES[key]:
        if name in ep.columns:
            return np.asarray(ep.columns[name]).reshape(len(ep))
    return None


def demo_batch(ep: DatasetEpisode, spec: EnvSpec, *, actor_id: str, episode_end: str = "terminated",
               keys: dict[str, str] | None = None) -> TransitionBatch:
    """One dataset episode as a record batch ending with an ``is_last`` record."""
    keys = keys or {}
    cols = {keys.get(k, k): v for k, v in ep.columns.items()}
    images = {keys.get(k, k): v for k, v in ep.images.items()}
    n = len(ep)
    if "is_last" in cols and "actor_episode" in cols:  # written by Tandem: exact
        from data.store import tandem_batch

        ep2 = DatasetEpisode(ep.index, cols, images, ep.tasks, ep.info)
        b = tandem_batch(ep2, spec)
        return TransitionBatch(actor_id, 0, {**b.arrays, "episode": np.full(n, ep.index, np.int64)},
                               b.tasks)
    for k in (OBS_STATE, "action"):
        if k not in cols:
            raise ValueError(f"demo dataset has no {k!r} column (has {sorted(cols)})")
    state = np.asarray(cols[OBS_STATE], np.float32).reshape(n, -1)
    action = np.asarray(cols["action"], np.float32).reshape(n, -1)
    if state.shape[1] != spec.state_dim or action.shape[1] != spec.action_dim:
        raise ValueError(f"demo state/action dims {state.shape[1]}/{action.shape[1]}, the env has "
                         f"{spec.state_dim}/{spec.action_dim}")
    m = n + 1  # + the is_last record (a copy of the last frame's observation)
    arrays: dict[str, np.ndarray] = {OBS_STATE: np.concatenate([state, state[-1:]])}
    for k in spec.image_keys:
        if k not in images:
            raise ValueError(f"demo dataset has no camera {k!r} (has {sorted(images)}); map one "
                             "with keys={...}")
        img = images[k]
        want = tuple(spec.cameras[k.split(".")[-1]])
        if img.shape[1:] != want:
            raise ValueError(f"demo camera {k}: frames {img.shape[1:]}, the env has {want}")
        arrays[k] = np.concatenate([img, img[-1:]])
    arrays["action"] = np.concatenate([action, np.zeros_like(action[:1])])
    reward = _col(ep, "reward")
    arrays["reward"] = np.append(np.zeros(n, np.float32) if reward is None else reward.astype(np.float32),
                                 np.float32(0))
    term = _col(ep, "terminated")
    trunc = _col(ep, "truncated")
    term = np.zeros(n, bool) if term is None else term.astype(bool)
    trunc = np.zeros(n, bool) if trunc is None else trunc.astype(bool)
    if not (term[-1] or trunc[-1]):
        if episode_end == "terminated":
            term[-1] = True
        else:
            trunc[-1] = True
    trunc &= ~term
    arrays["terminated"] = np.append(term, False)
    arrays["truncated"] = np.append(trunc, False)
    succ = _col(ep, "success")
    success = bool(succ.any()) if succ is not None else True
    arrays["success"] = np.append(np.zeros(n, bool) if succ is None else succ.astype(bool), success)
    inter = _col(ep, "intervened")
    arrays["intervened"] = np.append(np.zeros(n, bool) if inter is None else inter.astype(bool), False)
    arrays["is_last"] = np.append(np.zeros(n, bool), True)
    pv = _col(ep, "policy_version")
    arrays["policy_version"] = np.append(np.full(n, -1, np.int64) if pv is None else pv.astype(np.int64),
                                         -1)
    arrays["episode"] = np.full(m, ep.index, np.int64)
    arrays["step"] = np.arange(m, dtype=np.int64)
    return TransitionBatch(actor_id, 0, arrays, list(ep.tasks) + [ep.tasks[-1] if ep.tasks else ""])


def load_demos(path: str | Path, spec: EnvSpec, *, capacity: int | None = None, seed: int = 0,
               device: str = "cpu", image_codec: str = "raw", episode_end: str = "terminated",
               keys: dict[str, str] | None = None) -> ReplayBuffer:
    """A :class:`ReplayBuffer` holding a local LeRobot dataset's episodes (the newest ones, if
    ``capacity`` records do not hold them all)."""
    path = Path(path)
    read_info(path)  # clear error for a non-dataset
    table = read_episode_table(path)
    if not table:
        raise ValueError(f"demo dataset {path} has no episodes")
    need = int(table["length"].sum()) + len(table["length"])  # + one is_last per episode
    cap = max(2, int(capacity) if capacity else need)
    buf = ReplayBuffer(cap, spec, seed=seed, device=device, image_codec=image_codec)
    t0 = time.monotonic()
    n_ep = 0
    for ep in read_episodes(path, max_frames=cap - len(table["length"]), progress="loading demos"):
        buf.add(demo_batch(ep, spec, actor_id=f"demo:{path.name}", episode_end=episode_end,
                           keys=keys), restored=True)
        n_ep += 1
    log.info("demos: %d episodes, %d transitions from %s in %.1fs", n_ep, len(buf), path,
             time.monotonic() - t0)
    return buf
