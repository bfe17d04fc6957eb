"""Where a ``point_reach_vl`` policy goes on the held-out episodes (a diagnostic, not a
registered measure): of each episode, whether it reached the instructed target (success),
passed within the success radius of the other target first or instead (``other``), or
neither before the time limit (``neither``). A policy that reads the image but not the
instruction reaches some target in most episodes and the right one in about half of them.

    python -m tools.experiments.vl_outcomes /tmp/rs_vl/rs_seed0/checkpoints/step_0000001657 [...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def outcomes(policy, env_cfg, episodes: int, *, seed: int) -> dict[str, float]:
    """Fractions of ``success`` / ``other`` / ``neither`` over ``episodes`` deterministic
    episodes with reset seeds ``seed + i``."""
    import torch

    from actor.loop import obs_arrays
    from envs.registry import make_env

    env = make_env(env_cfg)
    counts = {"success": 0, "other": 0, "neither": 0}
    try:
        for i in range(episodes):
            obs, info = env.reset(seed=seed + i)
            u = env.unwrapped
            other = u.targets[1 - info["task_id"]]
            touched_other, done = False, False
            while not done:
                arrays, tasks = obs_arrays(obs)
                batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
                batch["task"] = tasks
                with torch.no_grad():
                    chunk = policy.act(batch, deterministic=True).actions[0].cpu().numpy()
                for a in chunk:
                    obs, _, term, trunc, info = env.step(np.asarray(a, np.float32))
                    touched_other |= bool(np.linalg.norm(u.pos - other) <= u.cfg.success_radius)
                    if term or trunc:
                        done = True
                        break
            key = "other" if touched_other else ("success" if info["is_success"] else "neither")
            counts[key] += 1
    finally:
        env.close()
    return {k: v / episodes for k, v in counts.items()}


def main(argv=None) -> None:
    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, HELD_OUT_SEED, POLICY_O, checkpoint_weights
    from tools.sft import learner_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="learner checkpoint folders (step_...)")
    args = ap.parse_args(argv)
    cfg = learner_config([*ENV_O, *POLICY_O])
    for path in args.checkpoints:
        policy = build_policy(cfg.policy, env_spec(cfg.env))
        policy.load_trainable_state_dict(checkpoint_weights(Path(path)))
        policy.eval()
        print(json.dumps({"checkpoint": path, **outcomes(policy, cfg.env, HELD_OUT, seed=HELD_OUT_SEED)}))


if __name__ == "__main__":
    main()
