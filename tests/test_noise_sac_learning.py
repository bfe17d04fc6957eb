"""Noise-space SAC (DSRL) lifts a weak tiny PI0, through the real learner and actor processes
on loopback (CPU; issue 10, proof (b)).

Task: ``env=point_reach`` (one task, a random target every episode, one 32x32 camera, the
target also in the state; 0/1 outcome). Base: a tiny, architecturally faithful PI0 (chunk 4)
fitted by 250 flow-matching BC steps on 30 scripted demos
(:func:`tools.experiments.sac_learning.make_weak_base`, ``variant="noise"``): deliberately stopped early, it succeeds
~0.3 with N(0, I) noise, where best-of-8 noises reach ~0.75 (the DSRL premise: the noise can
steer it). Then ``python -m learner algo=sac_noise policy=pi0`` with the
frozen base and two ``python -m actor`` processes for 400 online episodes,
trained on the env's own dense reward (1 on success, else minus the distance); the outcome
measured is always the 0/1 success.

Asserted, on the same 50 fixed evaluation seeds: the trained noise actor (its mean noise)
succeeds at least 0.2 more often than the base with its own N(0, I) noise, and at least 0.2
more often than the untrained noise actor evaluated the same way (its mean noise, ~0: the
non-learning control, what a run whose actor never learns ends at). Training stops at 400
online episodes, not at a time: under load the same learning takes longer (the 480 s cap
only bounds a stuck run). Figures are printed (``pytest -s -n 0``). Measured, 2-core CPU shared
with the full suite (load 4.4-7.6): base 0.30, untrained actor (mean) 0.32 -> 0.78 (z 4.8 and
4.6), 404 episodes, 920 updates, 347 s of training, 545 s in all; an earlier run at load 5-6:
0.30 -> 0.78, 413 episodes, 334 s in all. With a 200 s cap instead, at load 6-7, it reached
only 0.48 (221 episodes, 580 updates; start-up alone took 80 s) and failed the margin: hence
the episode count. Not yet timed on quiet cores with these settings (expected ~4-4.5 min:
one actor, 250 episodes, load ~1.5 took 256 s and reached 0.54).

This task is the easy one (the target in the state); the same algorithm on ``env=point_reach_vl``
(image + instruction, no target in the state) against a more-BC control is pre-registered
claim 6 (docs/preregistered.md; tools/experiments/noise_vl_learning.py,
tests/test_noise_vl_learning.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem_testutil import two_proportion_z as _z

# about 5 minutes on 2 quiet cores, which the README's test command (~20 min) cannot carry:
# run it with TANDEM_LEARNING_TESTS=1 uv run --frozen pytest -q tests/test_noise_sac_learning.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get("TANDEM_LEARNING_TESTS"),
                                 reason="5-minute learning run: TANDEM_LEARNING_TESTS=1 uv run --frozen "
                                        "pytest -q tests/test_noise_sac_learning.py")]

EVAL_EPISODES = 50
MARGIN = 0.2
EPISODES = 400


def test_noise_sac_lifts_a_weak_pi0(tmp_path: Path):
    import time

    import torch

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from envs.registry import env_spec
    from tools.experiments.sac_learning import ALGO_O, CHUNK, ENV_O, evaluate, make_weak_base, train, trained_policy
    from tools.record_demos import env_config, record_demos

    torch.set_num_threads(1)
    t0 = time.monotonic()
    demos = tmp_path / "demos"
    record_demos(env_config(ENV_O), demos, 30, seed=1000)
    demos_s = time.monotonic() - t0
    base = make_weak_base("noise", tmp_path, demos, 250)
    spec = env_spec(env_config(ENV_O))
    frozen = Pi0Policy(Pi0PolicyConfig(checkpoint=str(base.ckpt), chunk_size=CHUNK, lora_rank=0, device="cpu"),
                       spec).eval()
    before = evaluate(frozen, EVAL_EPISODES)
    setup_s = time.monotonic() - t0

    # stop at a number of episodes, not a time: under load (the suite beside it) the same
    # learning takes longer; the time cap only bounds a stuck run
    res = train("noise", tmp_path, base, ALGO_O["noise"], "dense", episodes=EPISODES, max_s=480.0, poll_s=2.0,
                actors=2)
    run_dir = Path(res["run_dir"])
    assert "Traceback" not in (run_dir / "learner.log").read_text()
    policy, fresh, ckpt = trained_policy("noise", base, run_dir, ALGO_O["noise"])
    t1 = time.monotonic()
    after = evaluate(policy, EVAL_EPISODES, deterministic=True)
    policy.load_trainable_state_dict(fresh)
    control = evaluate(policy, EVAL_EPISODES, deterministic=True)
    eval_s = time.monotonic() - t1
    st = res["status"]
    trace = [(t["episodes"], t["success_window"]) for t in res["trace"]]
    print(f"\nnoise-space SAC on a tiny PI0 ({EVAL_EPISODES} fixed seeds): base {before:.2f}, untrained "
          f"noise actor (mean) {control:.2f} -> trained noise actor (mean) {after:.2f} "
          f"(z {_z(after, before, EVAL_EPISODES):.1f} vs base, {_z(after, control, EVAL_EPISODES):.1f} vs "
          f"control) | {st.get('episodes')} online episodes, {st.get('updates')} updates, "
          f"{st.get('env_steps')} env steps | setup {setup_s:.0f}s (demos {demos_s:.0f}s), training "
          f"{res['wall_s']:.0f}s, after + control evals {eval_s:.0f}s, "
          f"total {time.monotonic() - t0:.0f}s | online success window by episodes {trace}")
    assert st.get("updates", 0) > 100, st
    assert after >= before + MARGIN, (before, after, control)
    assert after >= control + MARGIN, (before, after, control)
