"""Noise-space SAC (DSRL) on ``env=point_reach_vl`` with its controls (docs/preregistered.md,
claim 6): a frozen weak tiny PI0 (image + instruction; the state holds no target) and a noise
actor trained by SAC that picks the initial noise of its flow, through the real learner and
actor processes on loopback (CPU). Claim 3's protocol (:mod:`tools.experiments.residual_vl_learning`)
with the PI0 and ``algo=sac_noise`` in place of the MLP and the residual.

Per run seed:

1. ``base``: a tiny PI0 in lerobot's layout (:func:`tools.make_tiny_checkpoints.make_pi0`, the
   architecture ``ARCH`` of claim 5 on the 32x32 image, chunk 4, weights drawn from the run seed),
   every weight fitted by ``BASE_STEPS`` flow-matching BC steps on the ``DEMOS`` scripted demos
   (:func:`tools.experiments.sac_learning.make_weak_base`'s recipe: AdamW lr ``BASE_LR``, batch
   ``BATCH``), then frozen; served with ``STEPS`` Euler steps.
2. ``untrained noise actor``: the base plus the noise actor as initialised (torch seed = run
   seed), no RL.
3. ``noise``: ``python -m learner algo=sac_noise policy=pi0`` around the frozen base and
   ``ACTORS`` remote ``python -m actor`` processes (SAC settings: ``ALGO_O``, those of
   :mod:`tools.experiments.sac_learning`'s noise variant), trained on the env's dense reward (1 on
   success, else minus the distance to the instructed target) until the learner has made
   ``UPDATES`` updates, then SIGINT (the final checkpoint). Its wall-clock is ``W``.
4. ``more-BC``: the base's weights, further flow-matching BC on the same demos for the same ``W``
   seconds in this process (claim 3's control, :func:`tools.experiments.residual_vl_learning.timed_bc`:
   2 torch threads, AdamW lr ``BASE_LR`` cosine to 1e-4 over the elapsed fraction of
   ``W``, batch ``BATCH``, gradient norm clipped at 1), no RL.

Every arm is measured the same way, deterministic, on the held-out episodes (reset seeds
``HELD_OUT_SEED + i``, :func:`tools.experiments.learning_run.evaluate_policy`): the PI0's flow
from zero noise (``start``, ``more-BC``), or from the noise actor's mean noise (``untrained``,
``noise``). Reported too, not in the rule: the base with N(0, I) noise, as it would serve.

``--premise N`` (pilots) adds the DSRL premise on N episodes of reset seeds 2,000,000+ (not
held-out ones): the base's success with one N(0, I) noise per chunk against best-of-8 (an
episode counts when any of 8 sampled rollouts succeeds).

A file ``<out>/pause`` makes the tool wait before its next seed. Each seed's summary is
appended to ``<out>/results.jsonl``::

    python -m tools.experiments.noise_vl_learning --out /tmp/noise_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import time
from pathlib import Path

from tools.experiments.learning_run import (evaluate_policy, passes_by_margin, run_seeds, seeds_parser,
                                            timed_control, train_to_updates, trained_policy)
from tools.experiments.residual_vl_learning import timed_bc
from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, HELD_OUT_SEED, prepare

#: claim 5's tiny PI0 architecture (``tools.experiments.rs_vl_learning.PI0_ARCH``) as a dict
ARCH = dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8, expert_width=32,
            expert_mlp_dim=64, vocab_size=512, vision_width=32, vision_depth=2, vision_heads=2, vision_mlp_dim=64,
            vision_patch=8)
CHUNK = 4
STEPS = 5
DEMOS = 10
BASE_STEPS = 400
BASE_LR = 3e-3
BATCH = 32
TRAIN_ENV_O = [*ENV_O, "env.dense_reward=true"]
ALGO_O = ["algo=sac_noise", "algo.learning_starts=200", "algo.batch_size=64", "algo.utd_ratio=4",
          "algo.critic_hidden_dims=[128,128]", "algo.publish_every=10", "algo.max_update_ratio=0.5",
          "algo.backup_entropy=false", "algo.init_temperature=0.005", "algo.actor_lr=1e-3", "algo.critic_lr=1e-3",
          "algo.tau=0.02", "algo.noise_actor_hidden_dims=[128,128]", "algo.noise_scale=1.5",
          "algo.noise_dims=action"]
UPDATES = 1500
ACTORS = 2
PREMISE_SEED = 2 * 10**6
#: the registered per-seed margin (docs/preregistered.md, claim 6)
MARGIN = 0.10


def seed_passes(r: dict, margin: float = MARGIN) -> bool:
    """Claim 6's per-seed rule: the noise actor's after >= start, more-BC after and the
    untrained noise actor, each + ``margin`` (rounded to 2 places: 100 episodes)."""
    return passes_by_margin(r, "noise_after", ("start", "more_bc_after", "untrained_noise_actor"), margin)


def policy_o(base: Path) -> list[str]:
    return ["policy=pi0", f"policy.checkpoint={base}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=0",
            "policy.device=cpu", f"policy.num_inference_steps={STEPS}"]


def make_base(out: Path, demos: Path, seed: int, steps: int = BASE_STEPS) -> Path:
    """The weak base (module docstring, step 1): its lerobot checkpoint folder."""
    from tools.experiments.sac_learning import _weak_pi0

    return _weak_pi0(out, demos, steps, lr=BASE_LR, batch=BATCH, seed=seed, env_o=ENV_O, arch=ARCH, image_size=32,
                     name=f"base_seed{seed}").ckpt


def pi0(base: Path):
    """The base PI0 as the learner builds it (``policy=pi0``, frozen settings), eval mode."""
    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.sft import learner_config

    cfg = learner_config([*ENV_O, *policy_o(base)])
    return build_policy(cfg.policy, env_spec(cfg.env)).eval()


def noise_policy(base: Path, seed: int, actor: dict | None = None, extra: tuple[str, ...] = ()):
    """The frozen base plus a noise actor, built as the learner builds it (``ALGO_O`` and the
    run's ``extra`` overrides; torch seed = ``seed``), with the ``actor``'s weights when given."""
    return trained_policy([*ENV_O, *policy_o(base), *ALGO_O, *extra], seed, actor)


def held_out(policy, deterministic: bool = True) -> float:
    from tools.sft import learner_config

    wins = evaluate_policy(policy, learner_config(ENV_O).env, HELD_OUT, seed=HELD_OUT_SEED,
                           deterministic=deterministic)
    return sum(wins) / len(wins)


def premise(policy, episodes: int, k: int = 8, seed: int = PREMISE_SEED) -> dict:
    """The DSRL premise (module docstring): success with one N(0, I) noise, and best-of-``k``."""
    import numpy as np
    import torch

    from actor.loop import obs_arrays
    from envs.registry import make_env
    from tools.sft import learner_config

    env = make_env(learner_config(ENV_O).env)
    wins = np.zeros((episodes, k), bool)
    try:
        for i in range(episodes):
            for j in range(k):
                torch.manual_seed(seed + 1000 * j + i)
                obs, _ = env.reset(seed=seed + i)
                done = False
                while not done:
                    arrays, tasks = obs_arrays(obs)
                    batch = {**{n: torch.from_numpy(v) for n, v in arrays.items()}, "task": tasks}
                    with torch.no_grad():
                        chunk = policy.act(batch).actions[0].numpy()
                    for a in chunk:
                        obs, _, term, trunc, info = env.step(np.asarray(a, np.float32))
                        wins[i, j] = bool(info.get("is_success", False))
                        if term or trunc:
                            done = True
                            break
    finally:
        env.close()
    return {"episodes": episodes, "k": k, "single": round(float(wins.mean()), 3),
            f"best_of_{k}": round(float(wins.any(1).mean()), 3)}


def train_noise(out: Path, base: Path, seed: int, *, updates: int, actors: int, max_s: float,
                extra: tuple[str, ...] = ()) -> dict:
    """Learner + ``actors`` actors until ``updates`` updates (or ``max_s``), then SIGINT
    (:func:`tools.experiments.learning_run.train_to_updates`)."""
    return train_to_updates(out, "noise", seed, [*TRAIN_ENV_O, *policy_o(base)], ALGO_O, updates=updates,
                            actors=actors, max_s=max_s, extra=extra)


def more_bc(demos: Path, base: Path, seed: int, seconds: float):
    """The base after flow-matching BC on the demos for ``seconds`` (module docstring, step 4):
    (the policy in eval mode, BC steps taken)."""
    from agents.rs.agent import bc_inputs
    from data.demos import load_demos

    policy = pi0(base)
    policy.inner.requires_grad_(True)
    buf = load_demos(demos, policy.spec.with_extras(policy.extras_spec()), seed=seed)
    steps = timed_bc(policy, lambda: policy.bc_loss(bc_inputs(buf.sample(BATCH, horizon=CHUNK))), seconds,
                     seed=seed, lr=BASE_LR, lr_min=1e-4)
    return policy.eval(), steps


def run_seed(out: Path, demos: Path, seed: int, *, updates: int = UPDATES, actors: int = ACTORS,
             base_steps: int = BASE_STEPS, premise_episodes: int = 0, max_s: float = 1200.0,
             extra: tuple[str, ...] = ()) -> dict:
    """Every arm of one seed (module docstring); the summary."""
    t0 = time.monotonic()
    base = make_base(out, demos, seed, base_steps)
    frozen = pi0(base)
    start, base_sampled = held_out(frozen), held_out(frozen, deterministic=False)
    prem = premise(frozen, premise_episodes) if premise_episodes else None
    untrained = held_out(noise_policy(base, seed, extra=extra))
    print(f"[seed {seed}] start {start} base N(0,I) {base_sampled} untrained {untrained} premise {prem}", flush=True)
    r = train_noise(out, base, seed, updates=updates, actors=actors, max_s=max_s, extra=extra)
    after = held_out(noise_policy(base, seed, r["policy"], extra))
    control = timed_control(lambda: more_bc(demos, base, seed, r["wall_s"]), held_out)
    st = r["status"]
    return {"seed": seed, "start": start, "base_sampled": base_sampled, "untrained_noise_actor": untrained,
            "noise_after": after, **control, "premise": prem,
            "held_out_episodes": HELD_OUT, "base_steps": base_steps, "online_episodes": st.get("episodes"),
            "env_steps": st.get("env_steps"), "updates": st.get("updates"),
            "online_success_window": st.get("success"), "noise_checkpoint": r["checkpoint"],
            "noise_wall_s": r["wall_s"], "noise_load_1min": r["load_1min"], "trace": r["trace"],
            "seed_wall_s": round(time.monotonic() - t0, 1), "overrides": list(extra), "run_dir": r["run_dir"]}


def main(argv=None) -> list[dict]:
    ap = seeds_parser(__doc__, 1200.0)
    ap.add_argument("--updates", type=int, default=UPDATES, help="learner updates of the noise-SAC run")
    ap.add_argument("--actors", type=int, default=ACTORS)
    ap.add_argument("--base-steps", type=int, default=BASE_STEPS, help="BC steps of the weak base")
    ap.add_argument("--premise", type=int, default=0, help="pilots: DSRL premise on this many episodes")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the evaluations: the learner and actors get their own processes
    return run_seeds(args, lambda out: prepare(out, DEMOS), lambda out, demos, seed: [lambda: run_seed(
        out, demos, seed, updates=args.updates, actors=args.actors, base_steps=args.base_steps,
        premise_episodes=args.premise, max_s=args.max_s, extra=tuple(args.overrides))], hide=("trace",))


if __name__ == "__main__":
    main()
