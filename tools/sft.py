"""Supervised fine-tuning on demonstrations: the starting point of an RL run.

SimpleVLA-RL and πRL start RL from an SFT checkpoint (one demo per task, or a few). This
tool fits the configured policy's own BC loss (``bc_loss``: PI0's flow matching, OFT's L1 or
token cross-entropy, the MLP's NLL) on a local LeRobot demo dataset for ``--steps`` steps
and writes the policy's trainable state (LoRA adapters + heads, or the whole small policy)
as safetensors (``--out``); the learner starts from it with ``policy.init_trainable=<file>``.
A model trained from scratch (``policy=pi0_small``) is written whole instead
(``--save-checkpoint DIR``: weights, sizes, tokenizer, and state/action statistics fitted to
the demos before training); the learner loads it with ``policy.checkpoint=DIR``. Before
and after, it can run the deterministic policy in the env for ``--eval-episodes`` episodes
(reset seeds 10**6 + i) and print the success rates.

    python -m tools.sft --demos demos/ --steps 200 --out sft.safetensors --eval-episodes 20 \\
        env=point_reach policy=openvla_oft_discrete policy.checkpoint=tiny/oft ...

Hydra overrides after the flags are the learner's (``env=``, ``policy=``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger("tandem.tools.sft")


def learner_config(overrides: Sequence[str]):
    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1] / "config"
    with initialize_config_dir(config_dir=str(root), version_base=None):
        return compose(config_name="learner", overrides=list(overrides))


def evaluate(policy, env_cfg, episodes: int, *, seed0: int = 10**6) -> float:
    """Success rate of the deterministic policy over ``episodes`` episodes in the real env
    (chunks executed open-loop, as the actor does)."""
    from envs.registry import make_env

    env = make_env(env_cfg)
    wins = 0
    was_training = policy.training
    policy.eval()
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed0 + i)
            done = False
            while not done:
                batch = {k: torch.as_tensor(np.asarray(v)[None]) for k, v in obs.items() if k != "task"}
                if "task" in obs:
                    batch["task"] = [obs["task"]]
                chunk = policy.act(batch, deterministic=True).actions[0].cpu().numpy()
                for a in chunk:
                    obs, _, term, trunc, info = env.step(a)
                    if term or trunc:
                        wins += bool(info.get("is_success", False))
                        done = True
                        break
    finally:
        env.close()
        policy.train(was_training)
    return wins / max(episodes, 1)


def sft(policy, demos, *, steps: int, batch_size: int, lr: float, lr_min: float,
        max_grad_norm: float | None = 1.0, warmup: int = 0, log_every: int = 500) -> list[float]:
    """``steps`` AdamW steps of ``policy.bc_loss`` on chunk windows of ``demos`` (lr rising
    linearly over ``warmup`` steps, then a cosine to ``lr_min``)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    horizon = int(getattr(policy, "chunk_size", 1))
    losses = []
    policy.train()
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * (i + 1) / warmup if i < warmup else \
                lr_min + 0.5 * (lr - lr_min) * (1 + np.cos(np.pi * (i - warmup) / max(steps - warmup, 1)))
        batch = demos.sample(batch_size, horizon=horizon)
        loss = policy.bc_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and (i + 1) % log_every == 0:
            log.info("sft step %d/%d: loss %.4f (mean of the last %d)", i + 1, steps,
                     float(np.mean(losses[-log_every:])), log_every)
    return losses


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demos", required=True, help="local LeRobot dataset of demonstrations")
    ap.add_argument("--out", default=None, help="safetensors file of the trainable state (policy.init_trainable)")
    ap.add_argument("--save-checkpoint", default=None,
                    help="also write the whole model as a checkpoint folder (policy.checkpoint), with "
                         "normalisation statistics fitted to the demos: a model trained from scratch")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-min", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=0, help="steps of linear lr warm-up")
    ap.add_argument("--eval-episodes", type=int, default=0, help="evaluate before and after (0: no)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*", help="learner Hydra overrides (env=..., policy=...)")
    args = ap.parse_args(argv)
    if not (args.out or args.save_checkpoint):
        ap.error("give --out, --save-checkpoint or both")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from safetensors.torch import save_file

    from agents.registry import build_policy
    from data.demos import load_demos
    from envs.registry import env_spec

    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = learner_config(args.overrides)
    torch.set_float32_matmul_precision(str(cfg.trainer.matmul_precision))  # as the learner's updates
    spec = env_spec(cfg.env)
    policy = build_policy(cfg.policy, spec)
    if not hasattr(policy, "bc_loss"):
        raise SystemExit(f"policy={cfg.policy.name} has no bc_loss: it cannot be fine-tuned on demos")
    demos = load_demos(args.demos, spec, seed=args.seed, device=str(getattr(policy, "device", "cpu")))
    report: dict = {"policy": cfg.policy.name, "demo_transitions": len(demos), "steps": args.steps,
                    "matmul_precision": str(cfg.trainer.matmul_precision),
                    "parameters": sum(p.numel() for p in policy.parameters()),
                    "trained_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad)}
    if args.save_checkpoint:
        if not hasattr(policy, "fit_normalization"):
            raise SystemExit(f"policy={cfg.policy.name} cannot be saved as a checkpoint (no fit_normalization)")
        policy.fit_normalization(*demos.state_action())
    if args.eval_episodes:
        report["success_before"] = evaluate(policy, cfg.env, args.eval_episodes)
    t0 = time.monotonic()
    losses = sft(policy, demos, steps=args.steps, batch_size=args.batch_size, lr=args.lr, lr_min=args.lr_min,
                 warmup=args.warmup)
    report.update(loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                  sft_s=round(time.monotonic() - t0, 1))
    if args.eval_episodes:
        report["success_after"] = evaluate(policy, cfg.env, args.eval_episodes)
        report["eval_episodes"] = args.eval_episodes
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in policy.trainable_state_dict().items()}
        save_file(state, str(out), metadata={"policy": str(cfg.policy.name), "tool": "tools.sft"})
        report["out"] = str(out)
    if args.save_checkpoint:
        report["checkpoint"] = str(policy.save_checkpoint(args.save_checkpoint))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
