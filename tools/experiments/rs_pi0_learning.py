"""Learning proof of rejection sampling (Hi-ORS style) on a tiny PI0, through the real learner
and actor processes on loopback (CPU; issue 10, proof (a)).

1. Scripted demos of ``env=point_reach`` (one task, a random target every episode, one 32x32
   camera, the target also in the state; 0/1 outcome) from :func:`tools.record_demos.record_demos`.
2. A tiny, architecturally faithful PI0 with random weights
   (:func:`tools.make_tiny_checkpoints.make_pi0`, chunk 4), LoRA rank 4 plus the trained heads.
3. ``python -m learner algo=rejection_sampling policy=pi0`` pretrains it on the demos for
   ``algo.pretrain_steps`` BC steps (the deliberately weak start), evaluates that version with
   deterministic learner jobs (the baseline), then runs cycles: ``env_steps_per_cycle`` online
   env steps from ``python -m actor`` -> ``sft_steps_per_cycle`` BC steps on the success store
   (demos mixed in) -> a new version, evaluated (kept or rolled back).
4. Stops after ``--cycles`` evaluated cycles (a count, not a time: under load the same learning
   takes longer; ``--max-s`` only bounds a stuck run).

``--expert N``: the actor runs ``intervention.device=expert`` on its first N episodes (a
scripted person taking over when the policy drifts); evaluation jobs are never touched.
Prints and writes ``<out>/summary.json``: success before (the pretrained version) and after
(last and best evaluated version), online episodes, cycles, seconds, the success store::

    python -m tools.experiments.rs_pi0_learning --out /tmp/rs_pi0 --cycles 4
    python -m tools.experiments.rs_pi0_learning --out /tmp/rs_pi0_expert --cycles 4 --expert 50

Measured (tests/test_rs_pi0_learning.py, both runs at once, 2 cores at load 8-13): 0.13 ->
best 0.63 after 4 cycles (565 online episodes, 1,245 s); with 50 corrected episodes 0.07 ->
0.63 after one cycle, 0.83 after 4 (216 corrected steps, all in the success store). More
figures: that test's docstring. ``--cycles 4`` alone (defaults, load 4.9-9.9): 0.07 -> 0.43,
0.53, 0.60, 0.60; 556 online episodes, 502 updates, 662 s of the run, 708 s in all.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from tools.experiments.learning_run import free_port, run_rs_cycles

ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4
#: Euler steps of the flow per served chunk
INFERENCE_STEPS = 5
#: the learner's algo.* overrides
ALGO_O = ["algo=rejection_sampling", "algo.pretrain_steps=100", "algo.env_steps_per_cycle=300",
          "algo.sft_steps_per_cycle=100", "algo.lr=1e-3", "algo.demo_ratio=0.5", "algo.batch_size=64",
          "algo.eval_episodes=30", "algo.eval_tolerance=0.1"]


def policy_overrides(ckpt: Path, inference_steps: int = INFERENCE_STEPS) -> list[str]:
    return ["policy=pi0", f"policy.checkpoint={ckpt}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=4",
            "policy.device=cpu", f"policy.num_inference_steps={inference_steps}"]


def prepare(out: Path, demos: int, *, seed: int = 1000) -> tuple[Path, Path]:
    """The scripted demos and the random tiny PI0 (reused when ``out`` has them)."""
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0
    from tools.record_demos import env_config, record_demos

    d, ckpt = out / "demos", out / "pi0_random"
    if not d.exists():
        record_demos(env_config(ENV_O), d, demos, seed=seed)
    if not ckpt.exists():
        make_pi0(ckpt, env_spec(env_config(ENV_O)), chunk_size=CHUNK, seed=0)
    return d, ckpt


def run(out: Path, demos: Path, ckpt: Path, *, cycles: int, expert: int = 0, algo=ALGO_O,
        max_s: float = 900.0, seed: int = 0, extra: tuple[str, ...] = (),
        inference_steps: int = INFERENCE_STEPS) -> dict:
    """Learner + one actor until ``cycles`` evaluated cycles (``cycles`` + 1 evaluations, the
    baseline first), then SIGINT. Returns a summary (see the module docstring)."""
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    port, pub = free_port(), free_port()
    common = [*ENV_O, *policy_overrides(ckpt, inference_steps), f"run_dir={run_dir}", f"transport.port={port}",
              f"transport.pub_port={pub}", "transport.timeout_s=5.0", "transport.heartbeat_s=0.5"]
    learner_o = [*algo, f"buffer.demos={demos}", "device=cpu", "logging.wandb=disabled", "logging.every_s=2",
                 "trainer.num_threads=1", "buffer.video=false", "buffer.commit_interval_s=2", f"seed={seed}",
                 *extra]
    actor_o = ["actor_id=a0", "spool.fsync=false", "log_every_s=10", f"seed={seed}"]
    if expert:
        actor_o += ["intervention.device=expert", f"intervention.expert.episodes={expert}"]
    r = run_rs_cycles(run_dir, common, learner_o, actor_o, cycles=cycles, max_s=max_s)
    status, hist = r["status"], r["history"]
    rep = status.get("replay", {})
    after = hist[1:cycles + 1]
    return {"cycles": len(after), "before": hist[0]["success"] if hist else None,
            "after_last": after[-1]["success"] if after else None,
            "after_best": max(h["success"] for h in after) if after else None,
            "eval_episodes": hist[0]["episodes"] if hist else None,
            "evals": [(h["version"], h["success"], h["decision"]) for h in hist],
            "online_episodes": rep.get("episodes"), "kept_episodes": rep.get("kept_episodes"),
            "env_steps": status.get("env_steps"), "updates": status.get("updates"),
            "success_store": rep.get("success_store"), "success_store_intervened": rep.get("success_store_intervened"),
            "intervened_steps": rep.get("intervened_steps"), "intervened_episodes": rep.get("intervened_episodes"),
            "expert_episodes": expert, "wall_s": r["wall_s"], "load_1min": r["load_1min"], "run_dir": str(run_dir)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--demos", type=int, default=5, help="scripted demo episodes (seeds 1000...)")
    ap.add_argument("--cycles", type=int, default=4, help="stop after this many evaluated cycles")
    ap.add_argument("--expert", type=int, default=0, help="scripted expert corrects the first N episodes")
    ap.add_argument("--max-s", type=float, default=900.0, help="bounds a stuck run only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inference-steps", type=int, default=INFERENCE_STEPS, help="Euler steps per served chunk")
    ap.add_argument("overrides", nargs="*", help="extra learner overrides (after --)")
    args = ap.parse_args(argv)
    # SIGTERM stops the run like Ctrl-C: the learner and the actor are stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    demos, ckpt = prepare(out, args.demos)
    summary = run(out, demos, ckpt, cycles=args.cycles, expert=args.expert, max_s=args.max_s, seed=args.seed,
                  extra=tuple(args.overrides), inference_steps=args.inference_steps)
    summary["demos"], summary["total_wall_s"] = args.demos, round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
