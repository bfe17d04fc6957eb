"""Learning proof of residual SAC (PLD style) on a tiny OpenVLA-OFT (L1 head), through the real
learner and actors (issue 10, proof (c)).

1. Scripted demos of ``env=point_reach`` (one task, random target, one 32x32 camera, the
   target in the state; 0/1 outcome) from :func:`tools.record_demos.record_demos`.
2. A deliberately weak base: a tiny, architecturally faithful OFT
   (:func:`tools.make_tiny_checkpoints.make_openvla_oft`, chunk 4 x 2, its dataset statistics
   set to the env's ranges) fitted by ``--sft-steps`` of OFT's L1 loss on those demos
   (:func:`tools.sft.sft`: LoRA rank 8 + the action head + proprio projector), written as
   ``policy.init_trainable``.
3. Before, on ``--eval-episodes`` fixed seeds (50000...): the base alone (the L1 head is
   deterministic), and the untrained residual actor (sampled, and its mean ~0).
4. ``python -m learner algo=sac algo.action_space=residual policy=openvla_oft
   policy.init_trainable=<base>`` and ``--actors`` remote ``python -m actor`` processes on
   loopback until the learner counts ``--episodes`` online episodes (``--train-s`` caps a
   stuck run).
5. After: the learner's final checkpoint (the residual actor) around the same frozen base on
   the same seeds (deterministic: its mean residual; and sampled).

Reward: point_reach's ``dense_reward`` (1 on the success step, else minus the distance to the
target) by default, ``--reward sparse`` for 0/1; success (``info["is_success"]``, the 0/1
outcome) is what every figure measures. Prints a JSON summary and writes
``<out>/summary.json``::

    python -m tools.experiments.residual_sac_learning --out /tmp/residual_sac --episodes 300

WHY A RESIDUAL (and not SAC on the L1 head itself): the base VLA stays intact (frozen,
bit-identical; ``residual_scale`` bounds how far any action departs from it, which is what
makes it safe to run on a robot), the machinery is noise-space SAC's (a chunk actor over
frozen features, a critic over (features, stored extra), the feature cache), and the L1 head
is a deterministic regression: it has no likelihood, which SAC's entropy term on the head
itself would need.

Measured (shared 2-core CPU, other helpers' runs beside it; defaults of this file: 10 demos,
80 L1 steps, residual_scale 0.5, 2 actors, dense reward, 50 fixed seeds):
- base 0.34 (the L1 head, deterministic); untrained residual 0.34 (mean) / 0.34 (sampled);
- stop at 600 episodes (load 10.7-12.5): after 0.70 (mean residual) / 0.72 (sampled);
  637 online episodes, 11,716 env steps, 229 updates, 340 s of training (of which ~150 s
  the learner's start-up under that load), 572 s in all; the online 20-episode success
  window 0.15-0.4 up to ~120 updates, 0.6-0.75 from ~130 updates on;
- the gated test (tests/test_residual_sac_learning.py, the same settings, load 13-15):
  0.34 -> 0.70 (mean), 626 episodes, 217 updates, 262 s of training, 444 s in all;
- ``--reward sparse`` (trained on the 0/1 reward alone), stop at 600 episodes (load 12-14):
  0.34 -> 0.64 (mean) / 0.64 (sampled); 633 episodes, 253 updates, 262 s of training;
- an earlier run (stop at 300 episodes, but the processes ignored SIGINT, so they ran on:
  fixed since by resetting SIGINT in the children; load 8-12): 0.34 -> 0.72 (mean) / 0.68
  (sampled) with the periodic checkpoint at 476 updates.
The learner is the bottleneck (1-2 updates/s at load ~11; the actors make ~5 episodes/s),
so the online episodes per update are many; with ``buffer.persist=false`` (this tool) the
learner does not also write a dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4
#: the learner's algo.* overrides (noise-space SAC's proof settings, plus the residual's scale)
ALGO_O = ["algo.learning_starts=200", "algo.batch_size=64", "algo.utd_ratio=4", "algo.critic_hidden_dims=[128,128]",
          "algo.residual_actor_hidden_dims=[128,128]", "algo.publish_every=10", "algo.max_update_ratio=0.5",
          "algo.backup_entropy=false", "algo.init_temperature=0.005", "algo.actor_lr=1e-3", "algo.critic_lr=1e-3",
          "algo.tau=0.02", "algo.residual_scale=0.5"]


def policy_overrides(ckpt: Path, init: Path | None) -> list[str]:
    o = ["policy=openvla_oft", f"policy.checkpoint={ckpt}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=8",
         "policy.device=cpu"]
    return o + ([f"policy.init_trainable={init}"] if init else [])


def make_weak_base(out: Path, demos: Path, steps: int, *, lr: float = 1e-3, seed: int = 0) -> tuple[Path, Path]:
    """(tiny OFT checkpoint, its SFT trainable state): ``steps`` L1 steps on the demos."""
    import torch
    from safetensors.torch import save_file

    from agents.registry import build_policy
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_openvla_oft
    from tools.experiments.oft_grpo_demo import env_ranged_stats
    from tools.record_demos import env_config
    from tools.sft import sft

    spec = env_spec(env_config(ENV_O))
    ckpt = make_openvla_oft(out / "oft", spec, chunk_size=CHUNK, image_size=32, seed=seed)
    env_ranged_stats(ckpt, spec.action_dim, spec.state_dim)
    torch.manual_seed(seed)
    policy = build_policy({"name": "openvla_oft", "checkpoint": str(ckpt), "chunk_size": CHUNK, "lora_rank": 8,
                           "device": "cpu"}, spec)
    sft(policy, load_demos(demos, spec, seed=seed), steps=steps, batch_size=32, lr=lr, lr_min=lr / 10)
    init = out / "oft_weak.safetensors"
    save_file({k: v.contiguous() for k, v in policy.trainable_state_dict().items()}, str(init))
    return ckpt, init


def learner_cfg(ckpt: Path, init: Path, algo: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name="learner", overrides=[*ENV_O, *policy_overrides(ckpt, init), "algo=sac",
                                                         "algo.action_space=residual", *algo])


def residual_policy(ckpt: Path, init: Path, algo: list[str]):
    """The frozen weak base wrapped with a fresh residual actor, as the learner builds it."""
    from agents import registry
    from envs.registry import env_spec

    cfg = learner_cfg(ckpt, init, algo)
    builder = registry.build_builder(cfg.algo)
    return registry.build_trained_policy(builder, cfg.policy, env_spec(cfg.env)).eval()


def train(out: Path, ckpt: Path, init: Path, algo: list[str], reward: str = "dense", *, episodes: int,
          max_s: float, poll_s: float = 5.0, actors: int = 2) -> dict:
    """Learner + ``actors`` remote actors as processes until the learner counts ``episodes``
    online episodes (or ``max_s`` passes), then SIGINT (the learner checkpoints)."""
    from tools.experiments.learning_run import free_port, stop_processes

    run = out / "run"
    port, pub = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    common = [*ENV_O, f"env.dense_reward={str(reward == 'dense').lower()}", *policy_overrides(ckpt, init),
              f"run_dir={run}", f"transport.port={port}", f"transport.pub_port={pub}", "transport.timeout_s=5.0",
              "transport.heartbeat_s=0.5"]
    run.mkdir(parents=True, exist_ok=True)
    procs = []
    for module, args, log in (
            ("learner", ["algo=sac", "algo.action_space=residual", *algo, "device=cpu", "logging.wandb=disabled",
                         "logging.every_s=5", "trainer.num_threads=1", "buffer.persist=false"], "learner.log"),
            *(("actor", [f"actor_id=a{i}", "spool.fsync=false", "log_every_s=10", f"seed={i}"], f"actor{i}.log")
              for i in range(actors))):
        f = open(run / log, "ab")
        # SIGINT back to its default: a shell's background job ignores it, and so would the
        # children (then the learner never checkpoints at the stop)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *common, *args], cwd=ROOT, env=env,
                                      stdout=f, stderr=subprocess.STDOUT,
                                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
        time.sleep(3.0 if module == "learner" else 0.0)
    trace, t0, status = [], time.monotonic(), {}
    try:
        while time.monotonic() - t0 < max_s:
            time.sleep(poll_s)
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[2]} exited {p.returncode}; see {run}")
            try:
                status = json.loads((run / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            trace.append({"t_s": round(time.monotonic() - t0), "episodes": status.get("episodes"),
                          "success_window": status.get("success"), "updates": status.get("updates"),
                          "env_steps": status.get("env_steps"), "load1": round(os.getloadavg()[0], 1)})
            print(json.dumps(trace[-1]), flush=True)
            if (status.get("episodes") or 0) >= episodes:
                break
    finally:
        stop_processes(list(reversed(procs)), 120)
    status = json.loads((run / "status.json").read_text())
    return {"status": status, "trace": trace, "wall_s": time.monotonic() - t0, "run_dir": str(run)}


def trained_policy(ckpt: Path, init: Path, run_dir: Path, algo: list[str]):
    """(the frozen base with the learner's last residual actor, the fresh actor's state, path)."""
    from learner.checkpoint import latest_checkpoint, load_checkpoint

    policy = residual_policy(ckpt, init, algo)
    fresh = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise RuntimeError(f"no checkpoint in {run_dir}/checkpoints (did the learner update?)")
    policy.load_trainable_state_dict(load_checkpoint(path)["algo"]["agent"]["policy"])
    return policy, fresh, path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--demos", type=int, default=10, help="scripted demo episodes for the weak base")
    ap.add_argument("--sft-steps", type=int, default=80, help="L1 steps that make the weak base")
    ap.add_argument("--eval-episodes", type=int, default=50, help="fixed seeds 50000... for before and after")
    ap.add_argument("--episodes", type=int, default=300, help="stop training at this many online episodes")
    ap.add_argument("--train-s", type=float, default=600.0, help="time cap of training (a stuck run)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--reward", choices=("dense", "sparse"), default="dense")
    ap.add_argument("--algo", nargs="*", default=ALGO_O, help="algo.* overrides of the learner")
    args = ap.parse_args(argv)
    import torch

    from tools.experiments.noise_sac_learning import evaluate
    from tools.record_demos import env_config, record_demos

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    demos = out / "demos"
    if not demos.exists():
        record_demos(env_config(ENV_O), demos, args.demos, seed=1000)
    ckpt, init = make_weak_base(out, demos, args.sft_steps)
    policy = residual_policy(ckpt, init, args.algo)
    n = args.eval_episodes
    before = {"base": evaluate(policy.base, n, deterministic=True),
              "untrained_residual_mean": evaluate(policy, n, deterministic=True),
              "untrained_residual_sampled": evaluate(policy, n)}
    print("before", before, flush=True)
    setup_s = time.monotonic() - t0
    res = train(out, ckpt, init, args.algo, args.reward, episodes=args.episodes, max_s=args.train_s,
                actors=args.actors)
    policy, _, path = trained_policy(ckpt, init, Path(res["run_dir"]), args.algo)
    after = {"residual_mean": evaluate(policy, n, deterministic=True), "residual_sampled": evaluate(policy, n)}
    st = res["status"]
    summary = {"eval_episodes": n, "before": before, "after": after, "checkpoint": str(path),
               "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
               "updates": st.get("updates"), "policy_version": st.get("version"),
               "train_wall_s": round(res["wall_s"]), "setup_s": round(setup_s),
               "total_wall_s": round(time.monotonic() - t0), "algo": args.algo, "trace": res["trace"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "trace"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
