"""Pre-registered rejection-sampling runs on ``env=point_reach_vl`` (docs/preregistered.md),
through the real learner and actor processes on loopback (CPU).

The setting: two tasks whose targets are both drawn in every image on slots drawn every
episode; the instruction says which one; the state holds only the agent's position; reaching
takes at least 8 steps. The policy: the MLP with an image CNN and an instruction encoder
(``policy.task_embed_dim``). Per run seed and arm:

1. ``python -m learner algo=rejection_sampling`` pretrains on the scripted demos
   (:func:`tools.record_demos.record_demos`, the same for every seed) for ``pretrain_steps``
   BC steps, then runs ``cycles`` cycles with one ``python -m actor``; its own evaluation jobs
   (init states 0..9 of both tasks) decide keep / roll back.
2. Arm ``rs``: batches mix the success store and the demos (``algo.demo_ratio`` of
   :data:`ALGO_O`). Arm ``demos``, the control: the same run with ``algo.demo_ratio=1.0``, so
   every BC step of every cycle samples the demos alone and the online successes are unused
   (same steps, same evaluation gate).
3. Start and after are measured the same way, outside the run: the weights of the checkpoint
   written right after pretraining (``start``) and of the final checkpoint (``after``, the
   learner's current weights: the last kept version, or the best after a roll-back) run
   deterministically in-process on the held-out episodes, reset seeds
   ``HELD_OUT_SEED + i`` (:func:`tools.experiments.learning_run.evaluate_policy`), which neither the demos
   (seeds 1000+), the actor (its own seeded stream) nor the evaluation jobs (init states) use.
   ``untrained``: the same measurement of the policy as initialised (torch seed = run seed).

A file ``<out>/pause`` makes the tool wait before starting its next run (so that other work
can use the cores in between); removing it resumes.

Arm ``rs_expert`` (claim 7): the ``rs`` run with the env's scripted demonstrator correcting the
actor's first episodes (:data:`EXPERT_O`). ``--arm both`` runs each seed's RS run and its
control one after the other (``--arm claim7``: ``rs_expert`` and the control); the summary of
every run (with ``uptime`` at its end) is appended to ``<out>/results.jsonl`` as it ends::

    python -m tools.experiments.rs_vl_learning --out /tmp/rs_vl --seeds 0 1 2 3 4 --arm both
"""

from __future__ import annotations

from pathlib import Path

from tools.experiments.learning_run import evaluate_policy, free_port, run_rs_cycles, run_seeds, seeds_parser

ENV_O = ["env=point_reach_vl"]
POLICY_O = ["policy=mlp", "policy.hidden_dims=[64,64]", "+policy.task_embed_dim=16",
            "+policy.log_std_max=-1.0", "+policy.log_std_min=-3.0"]
#: claim 5's policy: lerobot's PI0 classes built from scratch at a tiny size (``policy=pi0_small``:
#: every parameter trains, the builtin tokenizer reads the instruction, a SigLIP tower on the
#: 32x32 image in 8-px patches), chunks of 4 actions from 5 Euler steps; weights drawn from
#: ``policy.seed`` (the run seed)
PI0_ARCH = ("{width: 64, depth: 2, mlp_dim: 128, num_heads: 8, num_kv_heads: 1, head_dim: 8, expert_width: 32, "
            "expert_mlp_dim: 64, vocab_size: 512, vision_width: 32, vision_depth: 2, vision_heads: 2, "
            "vision_mlp_dim: 64, vision_patch: 8}")
PI0_O = ["policy=pi0_small", "policy.image_size=32", f"policy.arch={PI0_ARCH}", "policy.chunk_size=4",
         "policy.num_inference_steps=5", "policy.device=cpu"]
#: ``--policy``: the MLP (claim 2) or the tiny PI0 (claim 5)
POLICIES = {"mlp": POLICY_O, "pi0": PI0_O}
PRETRAIN = 150
ALGO_O = ["algo=rejection_sampling", f"algo.pretrain_steps={PRETRAIN}", "algo.env_steps_per_cycle=800",
          "algo.sft_steps_per_cycle=300", "algo.lr=3e-3", "algo.demo_ratio=0.3", "algo.batch_size=64",
          "algo.eval_episodes=10", "algo.eval_task_ids=[0,1]", "algo.eval_tolerance=0.1"]
ARMS = {"rs": [], "demos": ["algo.demo_ratio=1.0"], "rs_expert": []}
#: claim 7's corrector on the actor (``intervention.device=expert``, envs/intervention/expert.py):
#: the env's scripted demonstrator watches the actor's first ``EXPERT_EPISODES`` episodes and
#: drives the rest of an episode once the policy's action is farther than ``drift_threshold``
#: (L2) from its own on ``drift_steps`` steps in a row; its steps reach the learner as
#: intervened records, kept by rejection sampling (``keep_interventions``, HG-DAgger / Hi-ORS)
EXPERT_EPISODES = 50
EXPERT_O = ["intervention.device=expert", f"intervention.expert.episodes={EXPERT_EPISODES}",
            "intervention.expert.drift_steps=3", "intervention.expert.drift_threshold=0.6"]
#: the actor's overrides per arm (the learner's are :data:`ARMS`)
ACTOR_ARMS = {"rs_expert": EXPERT_O}
DEMOS = 10
DEMO_SEED = 1000
CYCLES = 5
HELD_OUT = 100
HELD_OUT_SEED = 10**6


def prepare(out: Path, demos: int = DEMOS) -> Path:
    """The scripted demos (reused when ``out`` has them)."""
    from tools.record_demos import env_config, record_demos

    d = out / "demos"
    if not d.exists():
        record_demos(env_config(ENV_O), d, demos, seed=DEMO_SEED)
    return d


def policy_overrides(policy: str, seed: int) -> list[str]:
    """The ``policy.*`` overrides of ``--policy`` for a run (and its held-out evaluation) with
    this seed: the MLP's weights come from the torch seed, the PI0's from ``policy.seed``."""
    return [*POLICIES[policy], *([f"policy.seed={seed}"] if policy == "pi0" else [])]


def held_out(trainable: dict | None, episodes: int = HELD_OUT, seed: int = HELD_OUT_SEED,
             init_seed: int = 0, policy_name: str = "mlp") -> float:
    """Success of the policy with these trainable weights (None: as initialised after
    ``torch.manual_seed(init_seed)``, or from ``policy.seed=init_seed`` for PI0), deterministic
    (the PI0's flow from zero noise), on ``episodes`` held-out episodes (reset seeds ``seed + i``)."""
    import torch

    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.sft import learner_config

    cfg = learner_config([*ENV_O, *policy_overrides(policy_name, init_seed)])
    torch.manual_seed(init_seed)
    policy = build_policy(cfg.policy, env_spec(cfg.env))
    if trainable is not None:
        policy.load_trainable_state_dict(trainable)
    policy.eval()
    wins = evaluate_policy(policy, cfg.env, episodes, seed=seed, deterministic=True)
    return sum(wins) / len(wins)


def checkpoint_weights(path: Path) -> dict:
    """The policy's trainable weights in a learner checkpoint folder."""
    from learner.checkpoint import load_checkpoint

    return load_checkpoint(path)["algo"]["agent"]["policy"]


def run(out: Path, demos: Path, *, seed: int, arm: str, cycles: int = CYCLES, max_s: float = 900.0,
        extra: tuple[str, ...] = (), policy: str = "mlp") -> dict:
    """One learner + one actor until ``cycles`` evaluated cycles, then SIGINT; start and after
    on the held-out episodes (module docstring)."""
    run_dir = out / f"{arm}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=False)
    port, pub = free_port(), free_port()
    common = [*ENV_O, *policy_overrides(policy, seed), f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=5.0", "transport.heartbeat_s=0.5"]
    learner_o = [*ALGO_O, *ARMS[arm], f"buffer.demos={demos}", "device=cpu", "logging.wandb=disabled",
                 "logging.every_s=2", "trainer.num_threads=1", "buffer.video=false", "buffer.commit_interval_s=2",
                 f"seed={seed}", f"trainer.checkpoint_every={PRETRAIN}", "trainer.checkpoint_every_s=0",
                 "trainer.keep_checkpoints=1000", *extra]
    actor_o = ["actor_id=a0", "spool.fsync=false", "log_every_s=10", f"seed={seed}", *ACTOR_ARMS.get(arm, [])]
    r = run_rs_cycles(run_dir, common, learner_o, actor_o, cycles=cycles, max_s=max_s,
                      label=f"{arm} seed {seed} ")
    status, hist = r["status"], r["history"]
    rep = status.get("replay", {})
    ckpts = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    first = run_dir / "checkpoints" / f"step_{PRETRAIN:010d}"
    if not ckpts or not first.exists():
        raise RuntimeError(f"{run_dir}: no checkpoint after pretraining ({first.name}) or at the end")
    # built from seed 0 as claim 2's were; the PI0's trainable state is every weight it holds, so
    # its run seed does not matter once the checkpoint's weights are loaded
    start = held_out(checkpoint_weights(first), policy_name=policy)
    after = held_out(checkpoint_weights(ckpts[-1]), policy_name=policy)
    untrained = held_out(None, init_seed=seed, policy_name=policy)
    return {"policy": policy, "arm": arm, "seed": seed, "start": start, "after": after, "untrained": untrained,
            "held_out_episodes": HELD_OUT,
            "cycles": len(hist) - 1, "gate_evals": [(h["version"], h["success"], h["decision"]) for h in hist],
            "online_episodes": rep.get("episodes"), "kept_episodes": rep.get("kept_episodes"),
            "success_store": rep.get("success_store"), "intervened_episodes": rep.get("intervened_episodes"),
            "intervened_steps": rep.get("intervened_steps"), "updates": status.get("updates"),
            "env_steps": status.get("env_steps"), "final_checkpoint": ckpts[-1].name, "wall_s": r["wall_s"],
            "load_1min": r["load_1min"], "run_dir": str(run_dir)}


def main(argv=None) -> list[dict]:
    ap = seeds_parser(__doc__, 900.0)
    ap.add_argument("--arm", choices=[*ARMS, "both", "claim7"], default="both",
                    help="both: rs and demos (claims 2 and 5); claim7: rs_expert and demos")
    ap.add_argument("--cycles", type=int, default=CYCLES)
    ap.add_argument("--policy", choices=list(POLICIES), default="mlp",
                    help="mlp: claim 2's MLP + CNN + instruction encoder; pi0: claim 5's tiny PI0 from scratch")
    args = ap.parse_args(argv)
    arms = {"both": ["rs", "demos"], "claim7": ["rs_expert", "demos"]}.get(args.arm, [args.arm])
    return run_seeds(args, prepare, lambda out, demos, seed: [
        (lambda arm=arm: run(out, demos, seed=seed, arm=arm, cycles=args.cycles, max_s=args.max_s,
                             extra=tuple(args.overrides), policy=args.policy)) for arm in arms])


if __name__ == "__main__":
    main()
