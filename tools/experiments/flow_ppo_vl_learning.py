"""Flow-Noise PPO on ``env=point_reach_vl`` with its controls (docs/preregistered.md, claim 8): a
weak tiny PI0 (image + instruction; the state holds no target) fine-tuned by PPO on the env's
0/1 success through its Flow-Noise chain, through the real learner and actor processes on
loopback (CPU). Claim 6's protocol (:mod:`tools.experiments.noise_vl_learning`: the same base,
control and measurement) with ``algo=ppo policy.flow_rl=noise`` in place of noise-space SAC.

Per run seed:

1. ``base`` (``start``): claim 6's weak tiny PI0, built by the same function
   (:func:`tools.experiments.noise_vl_learning.make_base`: claim 5's architecture on the 32x32
   image, chunk 4, weights drawn from the run seed, every weight fitted by ``BASE_STEPS``
   flow-matching BC steps on the ``DEMOS`` scripted demos), served from zero noise with 5 Euler
   steps.
2. ``ppo``: ``python -m learner algo=ppo policy=pi0 policy.flow_rl=noise
   policy.checkpoint=<base>`` and ``ACTORS`` remote ``python -m actor`` processes with the recipe
   of :mod:`tools.experiments.flow_ppo_demo` (:data:`~tools.experiments.flow_ppo_demo.FLOW_O`:
   every chain from x_0 = 0, a per-step std held at 0.3, LoRA 8; with the PI0's action heads, the
   noise head and the value head, they are what trains;
   :data:`~tools.experiments.flow_ppo_demo.PPO_O`: rounds of 32 episodes, GAE, 2 epochs, lr 3e-4
   warmed up over 5 updates, episode-mean loss), on the env's sparse reward (1 on success, else
   0), until the learner has made ``UPDATES`` updates, then SIGINT (the final checkpoint). Its
   wall-clock from starting the processes to their exit is ``W``.
3. ``more-BC``: the base's weights, further flow-matching BC on the same demos for the same ``W``
   seconds (claim 6's control, :func:`tools.experiments.noise_vl_learning.more_bc`), no RL.

Every arm is measured the same way, deterministic, on the held-out episodes
(:func:`tools.experiments.noise_vl_learning.held_out`): the flow integrated from zero noise (the
flow-RL policy's deterministic act is the plain ODE from x_0 = 0, its noise head unused).
``untrained_flow_rl``: the base under the flow-RL wrapper as the learner builds it (LoRA B = 0,
the noise head as initialised), the same deterministic measurement: the start by construction,
measured to show it. Reported, not in the rule: ``base_sampled`` / ``ppo_after_sampled``, the
version-0 and the final policy sampled as the actors sample them (the chain's Gaussians, std 0.3).

``--arms ppo`` leaves out the more-BC control (pilots). A file ``<out>/pause`` makes the tool
wait before its next seed. Each seed's summary (``uptime`` at its end included) is appended to
``<out>/results.jsonl``::

    python -m tools.experiments.flow_ppo_vl_learning --out /tmp/flow_ppo_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tools.experiments.flow_ppo_demo import FLOW_O, PPO_O, split_policy_overrides
from tools.experiments.learning_run import (online_claim_args, passes_by_margin, run_seeds, timed_control,
                                            train_to_updates, trained_policy)
from tools.experiments.noise_vl_learning import BASE_STEPS, DEMOS, held_out, make_base, more_bc, pi0, policy_o
from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, prepare

UPDATES = 20
ACTORS = 2
#: the registered per-seed margin (docs/preregistered.md, claim 8)
MARGIN = 0.10


def seed_passes(r: dict, margin: float = MARGIN) -> bool:
    """Claim 8's per-seed rule: PPO's after >= start and more-BC after, each + ``margin``
    (rounded to 2 places: 100 episodes)."""
    return passes_by_margin(r, "ppo_after", ("start", "more_bc_after"), margin)


def flow_o(base: Path, extra: Sequence[str] = ()) -> list[str]:
    """The learner's and actors' policy overrides: the base as claim 6 serves it, under Flow-Noise
    with :data:`FLOW_O` (its LoRA rank in place of the frozen base's 0) and the run's ``policy.*``
    ``extra`` overrides."""
    return [*(o for o in policy_o(base) if not o.startswith("policy.lora_rank=")), "policy.flow_rl=noise", *FLOW_O,
            *split_policy_overrides(extra)[0]]


def ppo_policy(base: Path, seed: int, state: dict | None = None, extra: Sequence[str] = ()):
    """The flow-RL PI0 as the learner builds it (torch seed ``seed``), with a PPO checkpoint's
    ``policy`` state (the whole module's state dict) when given; eval mode."""
    policy = trained_policy([*ENV_O, *flow_o(base, extra), *PPO_O, *split_policy_overrides(extra)[1]], seed)
    if state is not None:
        policy.train()  # adapters unfolded: the module's layout the learner saved
        policy.load_state_dict(state)
    return policy.eval()


def train_ppo(out: Path, base: Path, seed: int, *, updates: int, actors: int, max_s: float,
              extra: Sequence[str] = ()) -> dict:
    """Learner + ``actors`` actors until ``updates`` updates (or ``max_s``), then SIGINT
    (:func:`tools.experiments.learning_run.train_to_updates`)."""
    return train_to_updates(out, "ppo", seed, [*ENV_O, *flow_o(base, extra)], PPO_O, updates=updates, actors=actors,
                            max_s=max_s, extra=split_policy_overrides(extra)[1])


def run_seed(out: Path, demos: Path, seed: int, *, updates: int = UPDATES, actors: int = ACTORS,
             base_steps: int = BASE_STEPS, max_s: float = 1200.0, control: bool = True,
             extra: tuple[str, ...] = ()) -> dict:
    """Every arm of one seed, one after the other (module docstring); the summary."""
    t0 = time.monotonic()
    base = make_base(out, demos, seed, base_steps)
    start = held_out(pi0(base))
    untrained = ppo_policy(base, seed, extra=extra)
    untrained_det, base_sampled = held_out(untrained), held_out(untrained, deterministic=False)
    print(f"[seed {seed}] start {start} untrained flow-RL {untrained_det} sampled {base_sampled}", flush=True)
    r = train_ppo(out, base, seed, updates=updates, actors=actors, max_s=max_s, extra=extra)
    trained = ppo_policy(base, seed, r["policy"], extra)
    after, after_sampled = held_out(trained), held_out(trained, deterministic=False)
    st = r["status"]
    summary = {"seed": seed, "start": start, "untrained_flow_rl": untrained_det, "base_sampled": base_sampled,
               "ppo_after": after, "ppo_after_sampled": after_sampled, "held_out_episodes": HELD_OUT,
               "base_steps": base_steps, "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
               "updates": st.get("updates"), "online_success_window": st.get("success"),
               "ppo_checkpoint": r["checkpoint"], "ppo_wall_s": r["wall_s"], "ppo_load_1min": r["load_1min"],
               "trace": r["trace"], "overrides": list(extra), "run_dir": r["run_dir"]}
    if control:
        summary.update(timed_control(lambda: more_bc(demos, base, seed, r["wall_s"]), held_out))
    summary["seed_wall_s"] = round(time.monotonic() - t0, 1)
    return summary


def parse_args(argv=None):
    return online_claim_args(__doc__, "ppo", argv, updates=UPDATES, actors=ACTORS, base_steps=BASE_STEPS,
                             base_what="BC")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the evaluations: the learner and actors get their own processes
    return run_seeds(args, lambda out: prepare(out, DEMOS), lambda out, demos, seed: [lambda: run_seed(
        out, demos, seed, updates=args.updates, actors=args.actors, base_steps=args.base_steps, max_s=args.max_s,
        control=args.arms == "all", extra=tuple(args.overrides))], hide=("trace",))


if __name__ == "__main__":
    main()
