"""Actors of one config start different episodes: the default reset seed comes from actor_id.

Every actor's episode counter starts at 0 and episode ``e`` resets with ``seed + e``; with one
seed for all (the old default, 0), N simulated actors played the same start states in step.
"""

from __future__ import annotations

import numpy as np
from omegaconf import OmegaConf

from actor.loop import actor_seed
from envs.registry import make_env
from tandem_testutil import ROOT


def _first_states(seed: int, n: int = 4) -> list[np.ndarray]:
    env = make_env({"name": "point_reach", "image_size": 16})
    try:
        return [np.asarray(env.reset(seed=seed + e)[0]["observation.state"]).copy() for e in range(n)]
    finally:
        env.close()


def test_default_seed_differs_per_actor_and_gives_other_starts():
    cfg = OmegaConf.load(ROOT / "config" / "actor.yaml")
    assert cfg.seed is None   # the shipped default derives it
    seeds = {a: actor_seed(cfg.seed, a) for a in (f"actor-{i}" for i in range(16))}
    assert len(set(seeds.values())) == 16, seeds
    assert all(0 <= s < 2**31 for s in seeds.values())
    assert actor_seed(None, "actor-3") == seeds["actor-3"]   # stable across restarts
    a, b = _first_states(seeds["actor-0"]), _first_states(seeds["actor-1"])
    assert not any(np.allclose(x, y) for x, y in zip(a, b)), (a, b)


def test_a_configured_seed_is_used_as_given():
    assert actor_seed(7, "actor-0") == actor_seed(7, "actor-9") == 7
    same = _first_states(actor_seed(0, "actor-0")), _first_states(actor_seed(0, "actor-1"))
    assert all(np.allclose(x, y) for x, y in zip(*same))
