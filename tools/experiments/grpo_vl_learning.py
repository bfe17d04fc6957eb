"""GRPO on ``env=point_reach_vl`` with its controls (docs/preregistered.md, claim 4): a weak
image + instruction MLP fine-tuned by GRPO on the env's sparse success, through the real
learner and actor processes on loopback (CPU).

Per run seed:

1. ``start``: the MLP of :mod:`tools.experiments.rs_vl_learning` (CNN + instruction encoder,
   std bounds [e^-3, e^-1]), torch seed = run seed, fitted by ``PRETRAIN`` BC steps on the
   ``DEMOS`` scripted demos (:func:`tools.experiments.residual_vl_learning.make_base`), saved
   as ``policy.init_trainable``. ``untrained`` is this start measured as it is (no RL, no
   more BC).
2. ``grpo``: ``python -m learner algo=grpo policy=mlp`` from the start and ``ACTORS`` remote
   ``python -m actor`` processes (settings: :data:`ALGO_O`). Each round the learner's job
   source issues ``batch_groups`` groups of ``group_size`` jobs, every job of a group the same
   task and initial state (targets' layout and start position); actors sample from the
   policy; an episode's score is its success (1/0), its advantage the score against its
   group's; groups all alike are dropped; one clipped-surrogate update per round. Stopped by
   SIGINT once the learner has made ``UPDATES`` updates; the final checkpoint's weights. Its
   wall-clock from starting the processes to their exit is ``W``.
3. ``more-BC``: the start's weights, further BC on the same demos for the same ``W`` seconds
   (:func:`tools.experiments.residual_vl_learning.more_bc`: 2 torch threads, AdamW, lr 3e-3
   cosine to 1e-4 over the elapsed fraction of ``W``, batch 64), no RL.

Every arm is measured the same way: deterministic (tanh of the mean), in-process, on the
held-out episodes, reset seeds ``HELD_OUT_SEED + i``
(:func:`tools.experiments.learning_run.evaluate_policy`).

``--arms grpo`` leaves out the more-BC control (pilots). A file ``<out>/pause`` makes the tool
wait before its next seed. Each seed's summary (``uptime`` at its end included) is appended
to ``<out>/results.jsonl``::

    python -m tools.experiments.grpo_vl_learning --out /tmp/grpo_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import time
from pathlib import Path

from tools.experiments.learning_run import (free_port, passes_by_margin, run_seeds, run_until_updates, seeds_parser,
                                            timed_control)
from tools.experiments.residual_vl_learning import held_out, make_base, mlp, more_bc, policy_o
from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, prepare

#: GRPO's settings (the rest: config/algo/grpo.yaml): both tasks, a fresh start state per group; no KL
#: penalty (the MLP keeps no reference copy: kl_coef > 0 needs a ReferencePolicy)
ALGO_O = ["algo=grpo", "algo.task_ids=[0,1]", "algo.group_size=16", "algo.batch_groups=4", "algo.lr=3e-4",
          "algo.epochs=4", "algo.minibatch_size=64", "algo.loss_agg=episode_mean", "algo.kl_coef=0.0",
          "algo.job_timeout_s=30", "algo.round_timeout_s=120"]
UPDATES = 40
ACTORS = 2


def train_grpo(out: Path, base: Path, seed: int, *, updates: int, actors: int, max_s: float,
               extra: tuple[str, ...] = ()) -> dict:
    """Learner + ``actors`` actors from the ``base`` weights until ``updates`` updates (or
    ``max_s``), then SIGINT; the learner's last status, the final checkpoint's policy weights (``policy``),
    ``wall_s``, the 1-min load and a trace [s, episodes, updates, success] every 10 s."""
    run = out / f"grpo_seed{seed}"
    run.mkdir(parents=True, exist_ok=False)
    port, pub = free_port(), free_port()
    common = [*ENV_O, *policy_o(base), f"run_dir={run}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=5.0", "transport.heartbeat_s=0.5"]
    learner_o = [*ALGO_O, "device=cpu", "logging.wandb=disabled", "logging.every_s=2", "trainer.num_threads=1",
                 "buffer.persist=false", "trainer.checkpoint_every=10", "trainer.keep_checkpoints=100",
                 "logging.stats_window=64", f"seed={seed}", f"algo.jobs_seed={seed}", *extra]
    return run_until_updates(run, common, learner_o, actors=actors, seed=seed, updates=updates, max_s=max_s,
                             poll_s=1.0, label="grpo")


#: the registered per-seed margin (docs/preregistered.md, claim 4)
MARGIN = 0.10


def seed_passes(r: dict, margin: float = MARGIN) -> bool:
    """Claim 4's per-seed rule: GRPO's after >= start and more-BC after, each + ``margin``
    (rounded to 2 places: 100 episodes)."""
    return passes_by_margin(r, "grpo_after", ("start", "more_bc_after"), margin)


def run_seed(out: Path, demos: Path, seed: int, *, updates: int = UPDATES, actors: int = ACTORS,
             max_s: float = 900.0, control: bool = True, extra: tuple[str, ...] = ()) -> dict:
    """Every arm of one seed, one after the other (module docstring); the summary."""
    t0 = time.monotonic()
    base = make_base(out, demos, seed)
    start = held_out(mlp(base=base))
    r = train_grpo(out, base, seed, updates=updates, actors=actors, max_s=max_s, extra=extra)
    after = held_out(mlp(r["policy"]))
    st = r["status"]
    summary = {"seed": seed, "start": start, "untrained": start, "grpo_after": after,
               "held_out_episodes": HELD_OUT, "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
               "updates": st.get("updates"), "online_success_window": st.get("success"),
               "grpo_checkpoint": r["checkpoint"], "grpo_wall_s": r["wall_s"], "grpo_load_1min": r["load_1min"],
               "trace": r["trace"], "overrides": list(extra), "run_dir": r["run_dir"]}
    if control:
        summary.update(timed_control(lambda: more_bc(demos, base, seed, r["wall_s"]), lambda w: held_out(mlp(w))))
    summary["seed_wall_s"] = round(time.monotonic() - t0, 1)
    return summary


def main(argv=None) -> list[dict]:
    ap = seeds_parser(__doc__, 900.0)
    ap.add_argument("--updates", type=int, default=UPDATES, help="learner updates (rounds) of the GRPO run")
    ap.add_argument("--actors", type=int, default=ACTORS)
    ap.add_argument("--arms", choices=["all", "grpo"], default="all", help="grpo: no more-BC control (pilots)")
    args = ap.parse_args(argv)
    return run_seeds(args, prepare, lambda out, demos, seed: [lambda: run_seed(
        out, demos, seed, updates=args.updates, actors=args.actors, max_s=args.max_s,
        control=args.arms == "all", extra=tuple(args.overrides))], hide=("trace",))


if __name__ == "__main__":
    main()
