"""PPO with Flow-Noise lifts a weak tiny PI0 on an image task with a 0/1 outcome, through the
real learner and actor processes on loopback (CPU; issue 9, proof (c)).

Task: ``env=point_reach`` (one task, a random target every episode, one 32x32 camera, the target
also in the state). Policy: the tiny PI0 of :func:`tools.make_tiny_checkpoints.make_pi0` (chunk
4, 4 Euler steps, LoRA 8 + the action heads + the noise head), 300 BC steps of its heads on 10
scripted demos as the weak start. Recipe: :data:`tools.experiments.flow_ppo_demo.FLOW_O` (every chain starts
at x_0 = 0, per-step std held at 0.3) and :data:`tools.experiments.flow_ppo_demo.PPO_O` (rounds of 32
episodes, GAE with the policy's value head, token-level clipped ratios over the chain's K x H
Gaussians, lr 3e-4 warmed up over 5 updates, 2 epochs, episode-mean loss). The run stops at
UPDATES updates, not at a time.

Asserted: the starting policy succeeds at most START_MAX over >= 200 episodes (200 run in process
before the RL run, pooled with the ones version 0 acted in through the actors), and the best window
of >= MIN_WINDOW consecutive episodes from version 1 on succeeds at least MARGIN more often and at
least AFTER_MIN. A ~220-episode window at p ~ 0.4 has a standard deviation of ~0.033, version 0's
~250 episodes ~0.03.

Measured on the 2-core machine (seed 0): start 0.3125 (256 episodes: 0.32 of 200 in process,
0.29 of 56 stored) -> ~220-episode windows 0.21, 0.38, 0.49, 0.62, 0.64, **0.66**, 0.65 (last 3
versions 0.68), 45 updates, 1,472 episodes, 724 s of RL, 13 min 12 s in all: passes. Before
chunks cut short trained on their executed actions (``algo.mask_unexecuted``; until then the
last chunk of every success, cut by the episode's end, left the policy loss): 0.315 -> best
window 0.55 (windows 0.35, 0.45, 0.44, 0.52, 0.46, 0.55, 0.54), 1,465 episodes, 859 s. Seeds 1
and 2 with the final code (the demo, 45 updates): 0.42 -> best window 0.89 and 0.51 -> 0.71 (seed
2 starts above START_MAX).

The same recipe on the CPUs of the 16-core GPU box, 10 runs at once, 7 minutes each (24-50
updates): a rise of >= 0.15 in 5 of 12 seeds (seed 0 0.31 -> 0.60, 1 0.42 -> 0.60, 2 0.51 ->
0.67, 4 0.34 -> 0.61, 5 0.27 -> 0.65), smaller rises in 6 (+0.07 to +0.14) and none in one (seed 10,
0.45 -> 0.40). BC on 10 demos starts anywhere in 0.27-0.65. The old recipe (std 0.15, LoRA 4,
rounds of 16, 5 demos; 10 runs on the box, starts measured over ~30 episodes) rose by 0.15 in none.
"""

from __future__ import annotations

import os

import pytest
from tandem_testutil import assert_learning_run_lifts, run_learning_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="Flow-Noise PPO learning run (~16 min on 2 cores)"
                                        ": TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q -s -n 0 "
                                        "tests/test_flow_ppo_learning.py")]

UPDATES = 45
SEED = 0
START_MAX = 0.45
MARGIN = 0.15
AFTER_MIN = 0.5
MIN_WINDOW = 150
MAX_MINUTES = 50.0  # bounds a stuck run only


def test_flow_noise_ppo_lifts_a_weak_tiny_pi0(tmp_path):
    from tools.experiments import flow_ppo_demo

    r = run_learning_demo(flow_ppo_demo.main, tmp_path / "run", updates=UPDATES, seed=SEED, max_minutes=MAX_MINUTES)
    assert_learning_run_lifts(r, updates=UPDATES, start_max=START_MAX, margin=MARGIN, min_window=MIN_WINDOW,
                              min_start_episodes=200, after_min=AFTER_MIN)
