"""The transport bench's specs, observations and transition batches (both processes build
them from the same ``cfg``)."""

from __future__ import annotations

import numpy as np

from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec, config_hash
from data.core.transitions import TransitionBatch
from tools.bench.common import bench_spec, episode_flags, random_images, random_obs

ACT_ACTOR = "bench-act"
INGEST_ACTOR = "bench-ingest"


def act_spec(cfg: dict) -> EnvSpec:
    return bench_spec(cfg["state_dim"], cfg["action_dim"], ["front"], cfg["act_image"])


def ingest_spec(cfg: dict) -> EnvSpec:
    return bench_spec(cfg["state_dim"], cfg["action_dim"], [f"cam{i}" for i in range(cfg["cameras"])],
                      cfg["ingest_image"])


def spec_hash(spec: EnvSpec, cfg: dict) -> str:
    return config_hash(spec, env_name="bench", policy_name="zeros", chunk=cfg["chunk"])


def act_observation(cfg: dict) -> dict[str, np.ndarray]:
    """One observation (batch of 1) of the act spec: normal float32 state, random image."""
    return random_obs(cfg["state_dim"], act_spec(cfg).cameras, n=1, seed=0, state="normal")


def ingest_images(cfg: dict) -> dict[str, np.ndarray]:
    """The images of one batch (reused by every batch: its content does not matter here)."""
    return random_images(np.random.default_rng(1), ingest_spec(cfg).cameras, cfg["batch_records"])


def make_batch(cfg: dict, images: dict[str, np.ndarray], first_seq: int, episode: int) -> TransitionBatch:
    """One episode of n-1 steps (the last one truncated) plus its is_last record."""
    n = cfg["batch_records"]
    rng = np.random.default_rng(episode)
    arrays = {
        OBS_STATE: rng.standard_normal((n, cfg["state_dim"]), dtype=np.float32),
        **images,
        "action": rng.uniform(-1, 1, (n, cfg["action_dim"])).astype(np.float32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        **episode_flags(n, episode),
    }
    return TransitionBatch(INGEST_ACTOR, first_seq, arrays, [""] * n)


def frames_nbytes(frames) -> int:
    return sum(memoryview(getattr(f, "buffer", f)).nbytes for f in frames)

