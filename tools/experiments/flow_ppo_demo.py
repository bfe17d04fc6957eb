"""PPO with Flow-Noise on a tiny PI0 learns ``env=point_reach`` (images + state, 0/1 outcome),
through the real learner and actor processes on loopback, from a deliberately weak BC policy.

1. a tiny PI0 (:func:`tools.make_tiny_checkpoints.make_pi0`, chunk 4) with random weights;
2. a few scripted expert episodes (:func:`tools.record_demos.run_episode`) and a short BC fit
   of its action heads on them (``--bc-steps``; no LoRA), written back as a lerobot checkpoint:
   the weak starting policy;
3. ``python -m learner algo=ppo policy=pi0 policy.flow_rl=noise policy.checkpoint=<that>``
   plus ``--actors`` actor processes, for ``--minutes`` (or until the success over the
   learner's last ``--window`` episodes reaches ``--target``);
4. success of the stored episodes by the policy version that acted in them (version 0 is the
   BC policy, sampled with its initial noise head), from the run's LeRobot dataset; version 0
   is also run in process before the RL run (``--start-episodes``, 200) and pooled into "before".

    python -m tools.experiments.flow_ppo_demo --out runs/flow_ppo --updates 45
    python -m tools.experiments.flow_ppo_demo --out runs/flow_ppo --updates 45 -- algo.lr=1e-4 policy.noise_std_max=0.5

The recipe (:data:`FLOW_O`, :data:`PPO_O`) is tests/test_flow_ppo_learning.py's, which gives the
measured figures: on the 2-core machine 0.31 (256 episodes) -> best window 0.66 in 45 updates;
on a 16-core box a rise of >= 0.15 in 5 of 12 seeds and smaller ones in 6 (docs/learning.md).
``--algo grpo`` trains the same policy with GRPO's group advantages instead (no critic), to tell
the critic from the policy.

Prints a JSON summary (before/after success with episode counts, updates, wall time) and
writes it to ``<out>/summary.json``. Extra Hydra overrides go after ``--``: ``policy.*`` ones
to the learner and the actors, the rest to the learner.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tools.experiments.learning_run import rl_minutes, run, run_args, start_out

ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4
#: the chain: a fixed start x_0 = 0 (flow_rl.py: with lerobot's x_0 ~ N(0, I) the weak flow passes
#: most of x_0 to the action, where log pi cannot see it) and a per-step std held at 0.3 (exploration:
#: at 0.15 the runs' outcomes hardly depended on the sampled chain, and they rose far less), LoRA 8
FLOW_O = ["policy.init_noise_scale=0", "policy.noise_std_min=0.3", "policy.noise_std_max=0.3001",
          "policy.lora_rank=8"]
#: the recipe of the learning test: rounds of 32 episodes, each episode weighted alike, GAE, the lr
#: warmed up over the first 5 updates
PPO_O = ["algo=ppo", "algo.batch_episodes=32", "algo.min_batch_chunks=0", "algo.minibatch_size=64",
         "algo.epochs=2", "algo.lr=3e-4", "algo.lr_warmup_updates=5", "algo.loss_agg=episode_mean",
         "algo.max_staleness=1"]


def split_policy_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the ``policy.*`` overrides, the rest): the first go to the actors too (an actor must build
    the learner's policy), the rest to the learner alone."""
    shared = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").startswith("policy.")]
    return shared, [o for o in overrides if o not in shared]


def demo_windows(env_cfg, episodes: int, seed: int, horizon: int) -> dict:
    """Scripted episodes cut into every step's action window [N, H, A] (+ ``action_is_pad``)."""
    from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
    from envs.registry import make_env
    from tools.record_demos import run_episode

    env = make_env(env_cfg)
    rows: dict[str, list] = {}
    wins = 0
    try:
        for i in range(episodes):
            recs, ok = run_episode(env, i, seed + i)
            wins += ok
            steps = [r for r in recs if not r["is_last"]]
            acts = np.stack([r["action"] for r in steps])
            for s, r in enumerate(steps):
                win = acts[s:s + horizon]
                pad = np.zeros(horizon, bool)
                pad[len(win):] = True
                win = np.concatenate([win, np.repeat(win[-1:], horizon - len(win), 0)])
                for k, v in r.items():
                    if k.startswith(OBS_IMAGE_PREFIX) or k in (OBS_STATE, TASK):
                        rows.setdefault(k, []).append(v)
                rows.setdefault("action", []).append(win)
                rows.setdefault("action_is_pad", []).append(pad)
    finally:
        env.close()
    out = {k: (v if k == TASK else torch.from_numpy(np.stack(v))) for k, v in rows.items()}
    out["_expert_success"] = wins / episodes
    return out


def bc_checkpoint(out: Path, env_cfg, *, demos: int, bc_steps: int, seed: int,
                  device: str = "cpu") -> tuple[Path, dict]:
    """The weak starting policy: a tiny PI0 whose heads saw ``bc_steps`` BC steps on the demos."""
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, save_lerobot_checkpoint
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0

    spec = env_spec(env_cfg)
    base = make_pi0(out / "tiny_pi0", spec, chunk_size=CHUNK, seed=seed)
    data = demo_windows(env_cfg, demos, seed=5000, horizon=CHUNK)
    torch.manual_seed(seed)
    p = Pi0Policy(Pi0PolicyConfig(checkpoint=str(base), chunk_size=CHUNK, lora_rank=0, device=device), spec).train()
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-3)
    n, losses = len(data["action"]), []
    for _ in range(bc_steps):
        idx = torch.randint(0, n, (32,))
        batch = {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx])
                 for k, v in data.items() if not k.startswith("_")}
        loss = p.bc_loss({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    path = save_lerobot_checkpoint(p.inner.cpu(), out / "bc_pi0", p.arch,
                                  p.stats and {k: v.cpu() for k, v in p.stats.items()})
    (path / "tokenizer").symlink_to((base / "tokenizer").resolve())
    info = {"demo_episodes": demos, "demo_windows": n, "expert_success": data["_expert_success"],
            "bc_steps": bc_steps, "bc_loss_first": float(np.mean(losses[:10] or [0])),
            "bc_loss_last": float(np.mean(losses[-10:] or [0]))}
    return path, info


def start_eval(common: Sequence[str], env_cfg, episodes: int, seed: int) -> list[bool]:
    """Version 0 measured in process before the RL run: the policy the learner builds from
    ``common`` (the BC checkpoint under the flow-RL wrapper: LoRA at zero, the noise head at its
    initial std), sampled as the actors sample it, over ``episodes`` fresh seeds."""
    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.experiments.learning_run import evaluate_policy
    from tools.sft import learner_config

    policy = build_policy(learner_config(list(common)).policy, env_spec(env_cfg)).eval()
    return evaluate_policy(policy, env_cfg, episodes, seed=seed)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = run_args(__doc__, minutes=14.0, demos=10, target=0.9, window=50)
    ap.add_argument("--bc-steps", type=int, default=300)
    ap.add_argument("--bc-device", default=None, help="device of the BC fit (default: --device)")
    ap.add_argument("--start-episodes", type=int, default=200,
                    help="episodes of the starting policy run in process before RL (0: none); pooled with "
                         "version 0's stored episodes into 'before'")
    ap.add_argument("--algo", choices=("ppo", "grpo"), default="ppo",
                    help="grpo: the same policy under group-relative advantages (no critic), a diagnostic")
    a = ap.parse_args(argv)
    out = start_out(a.out)
    torch.set_num_threads(2)
    from tools.record_demos import env_config

    env_cfg = env_config(ENV_O)
    t0 = time.monotonic()
    ckpt, bc = bc_checkpoint(out, env_cfg, demos=a.demos, bc_steps=a.bc_steps, seed=a.seed,
                              device=a.bc_device or a.device)
    bc["bc_s"] = round(time.monotonic() - t0, 1)
    print("weak BC policy:", json.dumps(bc), flush=True)
    common = [*ENV_O, "policy=pi0", f"policy.checkpoint={ckpt}", f"policy.chunk_size={CHUNK}",
              "policy.flow_rl=noise", "policy.num_inference_steps=4", f"policy.device={a.device}"]
    common += FLOW_O
    shared, rest = split_policy_overrides(a.overrides)
    common += shared
    t1 = time.monotonic()
    start = start_eval(common, env_cfg, a.start_episodes, seed=900_000 + 1000 * a.seed) if a.start_episodes else []
    bc["start_eval_s"] = round(time.monotonic() - t1, 1)
    algo = (PPO_O if a.algo == "ppo" else
            ["algo=grpo", "algo.group_size=8", "algo.batch_groups=2", "algo.minibatch_size=64", "algo.epochs=2",
             "algo.lr=3e-5", "algo.loss_agg=episode_mean", "algo.job_timeout_s=60", "algo.round_timeout_s=120"])
    algo = [*algo, *rest]  # not += : PPO_O is this module's list
    res = run(out, common, algo, minutes=rl_minutes(a, t0), actors=a.actors,
              updates=a.updates, target=a.target, window=a.window,
              seed=a.seed, device=a.device)
    summary = {"bc": bc, **res}
    if start:  # version 0 = the in-process episodes + the ones the actors stored under version 0
        stored = res["before"]
        wins = sum(start) + (stored["success"] or 0.0) * stored["episodes"]
        n0 = len(start) + stored["episodes"]
        summary["before_stored"] = stored
        summary["before_in_process"] = {"success": float(np.mean(start)), "episodes": len(start)}
        summary["before"] = {"success": wins / n0, "episodes": n0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
