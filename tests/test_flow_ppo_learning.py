"""PPO with Flow-Noise lifts a weak tiny PI0 on an image task with a 0/1 outcome, through the
real learner and actor processes on loopback (CPU; issue 9, proof (c)).

Task: ``env=point_reach`` (one task, a random target every episode, one 32x32 camera, the target
also in the state). Policy: the tiny PI0 of :func:`tools.make_tiny_checkpoints.make_pi0` (chunk
4, 4 Euler steps, LoRA 4 + the action heads + the noise head), 300 BC steps of its heads on 5
scripted demos as the weak start. Recipe: :data:`tools.flow_ppo_demo.FLOW_O` (every chain starts
at x_0 = 0, per-step std 0.15) and :data:`tools.flow_ppo_demo.PPO_O` (rounds of 16 episodes,
GAE with the policy's value head, token-level clipped ratios over the chain's K x H Gaussians,
lr 3e-4, 2 epochs, episode-mean loss). The run stops at UPDATES updates, not at a time.

Asserted: the starting policy (the episodes version 0 acted in) succeeds at most START_MAX, and
the best window of >= MIN_WINDOW consecutive episodes from version 1 on succeeds at least MARGIN
more often. A window of ~200 episodes at p ~ 0.1 has a standard deviation of ~0.02.

Status: NOT MET on the 2-core machine. Seed 0 there: version 0 0.33 (27 episodes), 200-episode
windows 0.23, 0.18, 0.29, 0.35, 0.21, 0.35 over 65 updates (633 s): this test fails. Version 0's
27 episodes give a noisy start (0.07-0.42 across runs of the same BC recipe), and at lr 3e-4 the
first update's per-token KL was 0.1-0.4: it knocks the BC policy down before PPO climbs back.

Measured (the same recipe on the CPUs of the 16-core GPU box, 10 runs at once): version 0 0.07
(28 episodes) -> 200-episode windows 0.03, 0.05, 0.10, 0.21, 0.27 over 62 updates and 1,019
episodes in 430 s. With lerobot's x_0 ~ N(0, I) start and the same settings the runs rose
0.12-0.19 -> 0.25-0.32 over ~100 updates; the learned noise head within [0.1, 0.5] rose 0.14 ->
0.30 at lr 1e-4 and stayed at 0.04-0.10 at lr 3e-4.
"""

from __future__ import annotations

import json
import os

import pytest
from tandem_testutil import assert_learning_run_lifts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="Flow-Noise PPO learning run (~8 min on a free 16-core box, ~20 on 2 "
                                        "cores): TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s "
                                        "tests/test_flow_ppo_learning.py")]

UPDATES = 45
SEED = 0
START_MAX = 0.45
MARGIN = 0.15
AFTER_MIN = 0.5
MIN_WINDOW = 150
MAX_MINUTES = 50.0  # bounds a stuck run only


def test_flow_noise_ppo_lifts_a_weak_tiny_pi0(tmp_path):
    from tools import flow_ppo_demo

    r = flow_ppo_demo.main(["--out", str(tmp_path / "run"), "--updates", str(UPDATES),
                            "--minutes", str(MAX_MINUTES), "--seed", str(SEED), "--target", "1.01"])
    print(json.dumps({k: r[k] for k in ("episodes", "updates", "wall_s", "before", "windows")}))
    assert_learning_run_lifts(r, updates=UPDATES, start_max=START_MAX, margin=MARGIN, min_window=MIN_WINDOW,
                              min_start_episodes=200, after_min=AFTER_MIN)
