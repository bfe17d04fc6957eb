"""Residual SAC (PLD style) on ``env=point_reach_vl`` with its controls (docs/preregistered.md,
claim 3): a frozen weak image + instruction MLP plus a residual actor trained by SAC, through
the real learner and actor processes on loopback (CPU).

Per run seed:

1. ``base``: the MLP of :mod:`tools.experiments.rs_vl_learning` (CNN + instruction encoder,
   std bounds [e^-3, e^-1]), torch seed = run seed, fitted by ``PRETRAIN`` BC steps on the
   ``DEMOS`` scripted demos (:func:`tools.sft.sft`: batch 64, lr 3e-3 cosine to 1e-4, the
   schedule of rejection sampling's pretraining), saved as ``policy.init_trainable``.
2. ``untrained residual``: the base plus a residual actor as initialised (torch seed = run
   seed), no RL.
3. ``residual``: ``python -m learner algo=sac_residual policy=mlp`` around the frozen base and
   ``ACTORS`` remote ``python -m actor`` processes (SAC settings: ``ALGO_O``), trained on the
   env's dense reward (1 on success, else minus the distance to the instructed target) until
   the learner has made ``UPDATES`` updates, then SIGINT (the learner checkpoints; one every
   500 updates is kept too). Its wall-clock from starting the processes to their exit is ``W``.
4. ``more-BC``: the base's weights, further BC on the same demos for the same ``W`` seconds in
   this process (``BC_THREADS`` torch threads; AdamW, lr ``BC_LR`` cosine to 1e-4 over the
   elapsed fraction of ``W``, batch 64, gradient norm clipped at 1), no RL.

Every arm is measured the same way: deterministic (the base's tanh(mean), plus the residual
actor's mean residual where there is one), in-process, on the held-out episodes, reset seeds
``HELD_OUT_SEED + i`` (:func:`tools.experiments.learning_run.evaluate_policy`). ``start`` is the
base alone.

A file ``<out>/pause`` makes the tool wait before its next seed; removing it resumes. Each
seed's summary (``uptime`` at its end included) is appended to ``<out>/results.jsonl``::

    python -m tools.experiments.residual_vl_learning --out /tmp/res_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from tools.experiments.learning_run import (evaluate_policy, passes_by_margin, run_seeds, seeds_parser,
                                            timed_control, train_to_updates, trained_policy)
from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, HELD_OUT_SEED, POLICY_O, PRETRAIN, prepare

ROOT = Path(__file__).resolve().parents[2]
#: what the learner and actors run (the held-out evaluation measures success, reward unused)
TRAIN_ENV_O = [*ENV_O, "env.dense_reward=true"]
ALGO_O = ["algo=sac_residual", "algo.learning_starts=200", "algo.batch_size=64", "algo.utd_ratio=4",
          "algo.critic_hidden_dims=[128,128]", "algo.residual_actor_hidden_dims=[128,128]",
          "algo.residual_scale=0.5", "algo.publish_every=10", "algo.max_update_ratio=0.5",
          "algo.backup_entropy=false", "algo.init_temperature=0.005", "algo.actor_lr=1e-3",
          "algo.critic_lr=1e-3", "algo.tau=0.02"]
UPDATES = 3000
ACTORS = 1
BC_LR = 3e-3
BC_THREADS = 2


def policy_o(base: Path) -> list[str]:
    return [*POLICY_O, f"policy.init_trainable={base}"]


def make_base(out: Path, demos: Path, seed: int) -> Path:
    """The weak base (module docstring, step 1) as a safetensors file of its weights."""
    import torch
    from safetensors.torch import save_file

    from agents.registry import build_policy
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.sft import learner_config, sft

    cfg = learner_config([*ENV_O, *POLICY_O])
    spec = env_spec(cfg.env)
    torch.manual_seed(seed)
    policy = build_policy(cfg.policy, spec)
    sft(policy, load_demos(demos, spec, seed=seed), steps=PRETRAIN, batch_size=64, lr=3e-3, lr_min=1e-4,
        log_every=0)
    path = out / f"base_seed{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in policy.trainable_state_dict().items()}, str(path))
    return path


def mlp(weights: dict | None = None, base: Path | None = None):
    """The MLP with the base's weights (``base``) or these ``weights``, in eval mode."""
    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.sft import learner_config

    cfg = learner_config([*ENV_O, *(policy_o(base) if base else POLICY_O)])
    policy = build_policy(cfg.policy, env_spec(cfg.env))
    if weights is not None:
        policy.load_trainable_state_dict(weights)
    return policy.eval()


def residual_policy(base: Path, seed: int, residual: dict | None = None, extra: tuple[str, ...] = ()):
    """The frozen base plus a residual actor, built as the learner builds it (``ALGO_O`` and
    the run's ``extra`` learner overrides; torch seed = ``seed``), with the ``residual``
    actor's weights when given; eval mode."""
    return trained_policy([*ENV_O, *policy_o(base), *ALGO_O, *extra], seed, residual)


def held_out(policy) -> float:
    """Deterministic success on the held-out episodes."""
    from tools.sft import learner_config

    wins = evaluate_policy(policy, learner_config(ENV_O).env, HELD_OUT, seed=HELD_OUT_SEED, deterministic=True)
    return sum(wins) / len(wins)


def train_residual(out: Path, base: Path, seed: int, *, updates: int, actors: int, max_s: float,
                   extra: tuple[str, ...] = ()) -> dict:
    """Learner + ``actors`` actors until ``updates`` updates (or ``max_s``), then
    SIGINT; the learner's last status, the final checkpoint's residual weights (``policy``), ``wall_s`` and
    the 1-min load every 10 s."""
    return train_to_updates(out, "residual", seed, [*TRAIN_ENV_O, *policy_o(base)], ALGO_O, updates=updates,
                            actors=actors, max_s=max_s, extra=extra)


def timed_bc(policy, loss, seconds: float, *, seed: int, lr: float = BC_LR, lr_min: float = 1e-4) -> int:
    """BC of ``policy``'s trainable parameters on ``loss()`` for ``seconds`` of wall-clock
    (``BC_THREADS`` torch threads, torch seed ``seed``; AdamW, lr ``lr`` cosine to ``lr_min``
    over the elapsed fraction of ``seconds``, gradient norm clipped at 1); the steps taken."""
    import torch

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(BC_THREADS)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.train()
    steps, t0 = 0, time.monotonic()
    try:
        while (frac := (time.monotonic() - t0) / seconds) < 1.0:
            for g in opt.param_groups:
                g["lr"] = lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * frac))
            value = loss()
            opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps += 1
    finally:
        torch.set_num_threads(threads)
    return steps


def more_bc(demos: Path, base: Path, seed: int, seconds: float) -> tuple[dict, int]:
    """The base's weights after BC on the demos for ``seconds`` of wall-clock (module docstring,
    step 4): (weights, BC steps taken)."""
    from data.demos import load_demos

    policy = mlp(base=base)
    buf = load_demos(demos, policy.spec, seed=seed)
    steps = timed_bc(policy, lambda: policy.bc_loss(buf.sample(64, horizon=1)), seconds, seed=seed)
    return policy.trainable_state_dict(), steps


#: the registered per-seed margin (docs/preregistered.md, claim 3)
MARGIN = 0.10


def seed_passes(r: dict, margin: float = MARGIN) -> bool:
    """Claim 3's per-seed rule: the residual's after >= start, more-BC after and the untrained
    residual, each + ``margin`` (rounded to 2 places: 100 episodes)."""
    return passes_by_margin(r, "residual_after", ("start", "more_bc_after", "untrained_residual"), margin)


def run_seed(out: Path, demos: Path, seed: int, *, updates: int = UPDATES, actors: int = ACTORS,
             max_s: float = 1200.0, extra: tuple[str, ...] = ()) -> dict:
    """Every arm of one seed (module docstring); the summary."""
    t0 = time.monotonic()
    base = make_base(out, demos, seed)
    start = held_out(mlp(base=base))
    untrained = held_out(residual_policy(base, seed, extra=extra))
    r = train_residual(out, base, seed, updates=updates, actors=actors, max_s=max_s, extra=extra)
    after = held_out(residual_policy(base, seed, r["policy"], extra))
    control = timed_control(lambda: more_bc(demos, base, seed, r["wall_s"]), lambda w: held_out(mlp(w)))
    st = r["status"]
    return {"seed": seed, "start": start, "untrained_residual": untrained, "residual_after": after, **control,
            "held_out_episodes": HELD_OUT, "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
            "updates": st.get("updates"), "online_success_window": st.get("success"),
            "residual_checkpoint": r["checkpoint"], "residual_wall_s": r["wall_s"],
            "residual_load_1min": r["load_1min"], "trace": r["trace"], "seed_wall_s": round(time.monotonic() - t0, 1),
            "overrides": list(extra), "run_dir": r["run_dir"]}


def main(argv=None) -> list[dict]:
    ap = seeds_parser(__doc__, 1200.0)
    ap.add_argument("--updates", type=int, default=UPDATES, help="learner updates of the residual run")
    ap.add_argument("--actors", type=int, default=ACTORS)
    args = ap.parse_args(argv)
    return run_seeds(args, prepare, lambda out, demos, seed: [lambda: run_seed(
        out, demos, seed, updates=args.updates, actors=args.actors, max_s=args.max_s,
        extra=tuple(args.overrides))], hide=("trace",))


if __name__ == "__main__":
    main()
