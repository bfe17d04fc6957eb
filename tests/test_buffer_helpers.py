"""Shared helpers of the replay / episode-store tests (no tests here).

Episodes are encoded so that any record can be checked against its successor:
``observation.state[0]`` = 1000 * episode + step, camera pixels = (7 * step + 13 * episode) % 256.
"""

from __future__ import annotations

import numpy as np

from data.core.transitions import TransitionBatch
from data.core.spec import EnvSpec

SPEC = EnvSpec(state_dim=3, action_dim=2, cameras={"front": (32, 32, 3), "wrist": (32, 32, 3)})
STATE_ONLY = EnvSpec(state_dim=3, action_dim=2)


def pixel(episode: int, step: int) -> int:
    return (7 * step + 13 * episode) % 256


def episode_records(episode: int, length: int, *, spec: EnvSpec = SPEC, success: bool = False,
                    terminated: bool = False, intervened_steps: tuple = (), policy_version: int = 0,
                    task: str = "reach", final: bool = True) -> list[dict]:
    """``length`` steps of one episode, then (``final``) its ``is_last`` record."""
    recs = []
    for t in range(length + (1 if final else 0)):
        last = t == length
        end = t == length - 1
        rec = {"observation.state": np.array([1000 * episode + t, t, -t], np.float32),
               "action": np.array([t, -t], np.float32) if not last else np.zeros(2, np.float32),
               "reward": np.float32(0.0 if last else t * 0.5),
               "terminated": bool(end and terminated), "truncated": bool(end and not terminated),
               "intervened": t in intervened_steps, "is_last": last,
               "success": bool(success and (end or last)), "policy_version": policy_version,
               "episode": episode, "step": t, "task": task}
        for k in spec.image_keys:
            rec[k] = np.full(spec.cameras[k.split(".")[-1]], pixel(episode, t), np.uint8)
        recs.append(rec)
    return recs


def batch(actor: str, first_seq: int, recs: list[dict]) -> TransitionBatch:
    return TransitionBatch.from_records(actor, first_seq, recs)


def episode_batch(actor: str, first_seq: int, episode: int, length: int, **kw) -> TransitionBatch:
    return batch(actor, first_seq, episode_records(episode, length, **kw))


def check_successor(sample: dict) -> None:
    """Every sampled transition's next observation is its successor record."""
    s = sample["observation.state"][:, 0].numpy()
    ns = sample["next.observation.state"][:, 0].numpy()
    assert (ns == s + 1).all(), (s, ns)
    for k in [k for k in sample if k.startswith("observation.images.")]:
        ep = (s // 1000).astype(int)
        step = (s % 1000).astype(int)
        want = (7 * step + 13 * ep) % 256
        got = sample[k][:, 0, 0, 0].numpy()
        nxt = sample["next." + k][:, 0, 0, 0].numpy()
        assert (got == want).all() and (nxt == (want + 7) % 256).all()
