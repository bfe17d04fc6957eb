"""GRPO on a tiny OpenVLA-OFT (discrete action tokens) on ``env=point_reach_vl`` with its
controls (docs/preregistered.md, claim 9): SimpleVLA-RL's recipe at toy scale where the image
and the instruction both matter (two tasks, both targets drawn, the state holds no target),
through the real learner and actor processes on loopback (CPU). The recipe of
:mod:`tools.experiments.oft_grpo_demo` (which runs on plain ``point_reach``, target in the state)
with claim 4's protocol (:mod:`tools.experiments.grpo_vl_learning`: both tasks, the same demos,
control and measurement).

Per run seed:

1. ``base`` (``start``): a tiny OFT built from scratch
   (:func:`tools.make_tiny_checkpoints.make_openvla_oft`: Llama 64 x 2 layers reading the prompt
   "What action should the robot take to {instruction}?", two ViTs 32 x 2 layers on the 32x32
   image, chunk ``CHUNK`` x 2 action tokens of 256 bins), weights drawn from the run seed, its
   dataset statistics set to the env's ranges
   (:func:`tools.experiments.oft_grpo_demo.env_ranged_stats`); :data:`POLICY_O` trains LoRA
   ``LORA_RANK`` in the language model, the LM head and the proprio projector, fitted by
   ``BASE_STEPS`` steps of the token cross-entropy (:func:`tools.sft.sft`: batch ``BATCH``, lr
   ``BASE_LR`` cosine to 1e-4, torch seed = run seed) on the ``DEMOS`` scripted demos of the other
   claims, saved as ``policy.init_trainable``.
2. ``grpo``: ``python -m learner algo=grpo policy=openvla_oft_discrete
   policy.init_trainable=<base>`` and ``ACTORS`` remote ``python -m actor`` processes
   (:data:`ALGO_O`: the demo's recipe, groups of 8, 4 groups a round, token-level clipped ratios,
   lr 3e-4, 2 epochs, episode-mean loss; tasks 0 and 1 in turn, a fresh initial state per group,
   ``algo.jobs_seed`` = run seed) on the env's 0/1 success, until the learner has made
   ``UPDATES`` updates, then SIGINT (the final checkpoint). Its wall-clock from starting the
   processes to their exit is ``W``.
3. ``more-BC``: the base's weights, further token cross-entropy on the same demos for the same
   ``W`` seconds (:func:`tools.experiments.residual_vl_learning.timed_bc`: 2 torch threads, AdamW,
   lr ``BASE_LR`` cosine to 1e-4 over the elapsed fraction of ``W``, batch ``BATCH``), no RL.

Every arm is measured the same way: deterministic (the greedy action tokens), in-process, on the
held-out episodes (:func:`tools.experiments.noise_vl_learning.held_out`: reset seeds
1,000,000 + i, 100 episodes). Reported, not in the rule: ``start_sampled`` /
``grpo_after_sampled``, the base and the final policy sampled as the actors sample them.

``--arms grpo`` leaves out the more-BC control (pilots). A file ``<out>/pause`` makes the tool
wait before its next seed. Each seed's summary (``uptime`` at its end included) is appended to
``<out>/results.jsonl``::

    python -m tools.experiments.oft_grpo_vl_learning --out /tmp/oft_grpo_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tools.experiments.learning_run import (online_claim_args, passes_by_margin, run_seeds, timed_control,
                                            train_to_updates)
from tools.experiments.noise_vl_learning import held_out
from tools.experiments.oft_grpo_demo import ALGO_O as DEMO_ALGO_O
from tools.experiments.oft_grpo_demo import CHUNK, LORA_RANK, tiny_oft  # noqa: F401 (LORA_RANK: the docstring's)
from tools.experiments.oft_grpo_demo import oft_policy_o as policy_o
from tools.experiments.residual_vl_learning import timed_bc
from tools.experiments.rs_vl_learning import DEMOS, ENV_O, HELD_OUT, prepare

BASE_STEPS = 400
BASE_LR = 5e-3
BATCH = 32
UPDATES = 60
ACTORS = 2
#: the demo's recipe on both tasks (claim 4's jobs: tasks 0 and 1 in turn, a fresh initial state per group)
ALGO_O = [*DEMO_ALGO_O, "algo.task_ids=[0,1]", "algo.kl_coef=0.0"]
#: the registered per-seed margin (docs/preregistered.md, claim 9)
MARGIN = 0.10


def seed_passes(r: dict, margin: float = MARGIN) -> bool:
    """Claim 9's per-seed rule: GRPO's after >= start and more-BC after, each + ``margin``
    (rounded to 2 places: 100 episodes)."""
    return passes_by_margin(r, "grpo_after", ("start", "more_bc_after"), margin)


def oft(ckpt: Path, init: Path | None = None, state: dict | None = None, seed: int = 0):
    """The tiny OFT as the learner builds it (torch seed ``seed``; LoRA A is drawn from it, B = 0),
    from ``init`` and then a GRPO checkpoint's ``policy`` state (the whole module's state dict)
    when given; eval mode."""
    import torch

    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.sft import learner_config

    cfg = learner_config([*ENV_O, *policy_o(ckpt, init)])
    torch.manual_seed(seed)
    policy = build_policy(cfg.policy, env_spec(cfg.env))
    if state is not None:
        policy.train()  # adapters unfolded: the module's layout the learner saved
        policy.load_state_dict(state)
    return policy.eval()


def make_oft(out: Path, seed: int) -> Path:
    """The tiny OFT checkpoint folder (weights from ``seed``, the env's ranges as statistics)."""
    from envs.registry import env_spec
    from tools.sft import learner_config

    return tiny_oft(out / f"oft_seed{seed}", env_spec(learner_config(ENV_O).env), seed)


def make_base(out: Path, demos: Path, seed: int, steps: int = BASE_STEPS) -> tuple[Path, Path]:
    """The weak base (module docstring, step 1): (the OFT folder, its SFT weights' file)."""
    import torch
    from safetensors.torch import save_file

    from data.demos import load_demos
    from tools.sft import sft

    ckpt = make_oft(out, seed)
    policy = oft(ckpt, seed=seed)
    torch.manual_seed(seed)
    sft(policy, load_demos(demos, policy.spec, seed=seed), steps=steps, batch_size=BATCH, lr=BASE_LR, lr_min=1e-4,
        log_every=0)
    init = out / f"base_seed{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in policy.trainable_state_dict().items()}, str(init))
    return ckpt, init


def more_bc(demos: Path, ckpt: Path, init: Path, seed: int, seconds: float):
    """The base after token cross-entropy on the demos for ``seconds`` (module docstring, step 3):
    (the policy in eval mode, BC steps taken)."""
    from data.demos import load_demos

    policy = oft(ckpt, init, seed=seed)
    buf = load_demos(demos, policy.spec, seed=seed)
    steps = timed_bc(policy, lambda: policy.bc_loss(buf.sample(BATCH, horizon=CHUNK)), seconds, seed=seed,
                     lr=BASE_LR, lr_min=1e-4)
    return policy.eval(), steps


def train_grpo(out: Path, ckpt: Path, init: Path, seed: int, *, updates: int, actors: int, max_s: float,
               extra: Sequence[str] = ()) -> dict:
    """Learner + ``actors`` actors until ``updates`` updates (or ``max_s``), then SIGINT
    (:func:`tools.experiments.learning_run.train_to_updates`)."""
    return train_to_updates(out, "grpo", seed, [*ENV_O, *policy_o(ckpt, init)],
                            [*ALGO_O, f"algo.jobs_seed={seed}"], updates=updates, actors=actors, max_s=max_s,
                            extra=extra)


def run_seed(out: Path, demos: Path, seed: int, *, updates: int = UPDATES, actors: int = ACTORS,
             base_steps: int = BASE_STEPS, max_s: float = 1200.0, control: bool = True,
             extra: tuple[str, ...] = ()) -> dict:
    """Every arm of one seed, one after the other (module docstring); the summary."""
    t0 = time.monotonic()
    ckpt, init = make_base(out, demos, seed, base_steps)
    base = oft(ckpt, init, seed=seed)
    start, start_sampled = held_out(base), held_out(base, deterministic=False)
    print(f"[seed {seed}] start {start} sampled {start_sampled} ({time.monotonic() - t0:.0f} s)", flush=True)
    r = train_grpo(out, ckpt, init, seed, updates=updates, actors=actors, max_s=max_s, extra=extra)
    trained = oft(ckpt, init, r["policy"], seed=seed)
    after, after_sampled = held_out(trained), held_out(trained, deterministic=False)
    print(f"[seed {seed}] grpo after {after} sampled {after_sampled}", flush=True)
    st = r["status"]
    summary = {"seed": seed, "start": start, "start_sampled": start_sampled, "grpo_after": after,
               "grpo_after_sampled": after_sampled, "held_out_episodes": HELD_OUT, "base_steps": base_steps,
               "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"), "updates": st.get("updates"),
               "online_success_window": st.get("success"), "grpo_checkpoint": r["checkpoint"],
               "grpo_wall_s": r["wall_s"], "grpo_load_1min": r["load_1min"], "trace": r["trace"],
               "overrides": list(extra), "run_dir": r["run_dir"]}
    if control:
        summary.update(timed_control(lambda: more_bc(demos, ckpt, init, seed, r["wall_s"]), held_out))
    summary["seed_wall_s"] = round(time.monotonic() - t0, 1)
    return summary


def parse_args(argv=None):
    return online_claim_args(__doc__, "grpo", argv, updates=UPDATES, actors=ACTORS, base_steps=BASE_STEPS,
                             base_what="SFT")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the evaluations: the learner and actors get their own processes
    return run_seeds(args, lambda out: prepare(out, DEMOS), lambda out, demos, seed: [lambda: run_seed(
        out, demos, seed, updates=args.updates, actors=args.actors, base_steps=args.base_steps, max_s=args.max_s,
        control=args.arms == "all", extra=tuple(args.overrides))], hide=("trace",))


if __name__ == "__main__":
    main()
