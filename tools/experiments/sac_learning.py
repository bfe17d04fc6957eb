"""Learning proof of SAC around a frozen VLA, through the real learner and actors, in one of two
variants (``--variant``):

- ``noise`` (DSRL): SAC trains a noise actor that picks the initial noise of a frozen tiny PI0
  (``algo=sac_noise``);
- ``residual`` (PLD style; issue 10, proof (c)): SAC trains a bounded residual added to a frozen
  tiny OpenVLA-OFT's L1 actions (``algo=sac_residual``).

Steps, the same for both:

1. Scripted demos of ``env=point_reach`` (one task, random target, one 32x32 camera, the
   target in the state; 0/1 outcome) from :func:`tools.record_demos.record_demos`.
2. A deliberately weak base fitted by ``--base-steps`` on those demos: ``noise``: a tiny,
   architecturally faithful PI0 (:func:`tools.make_tiny_checkpoints.make_pi0`, chunk 4), every
   weight trained by flow-matching BC, saved as a lerobot checkpoint; ``residual``: a tiny OFT
   (:func:`tools.make_tiny_checkpoints.make_openvla_oft`, chunk 4 x 2, dataset statistics set to
   the env's ranges) fitted by OFT's L1 loss (:func:`tools.sft.sft`: LoRA rank 8 + the action
   head + proprio projector), written as ``policy.init_trainable``.
3. Before, on ``--eval-episodes`` fixed seeds (50000...): the frozen base (``noise``: with N(0, I)
   noise as it serves, and with zero noise; ``residual``: the deterministic L1 head) and the
   untrained actor around it (its mean and sampled).
4. ``python -m learner algo=sac_<variant> ...`` and ``--actors`` remote
   ``python -m actor`` processes on loopback until the learner counts ``--episodes`` online
   episodes (0: until ``--train-s``; ``--train-s`` also caps a stuck run).
5. After: the learner's final checkpoint (the trained actor) around the same frozen base on the
   same seeds (deterministic: its mean; and sampled).

Reward: point_reach's ``dense_reward`` (1 on the success step, else minus the distance to the
target) by default, ``--reward sparse`` for 0/1; success (``info["is_success"]``, the 0/1
outcome) is what every figure measures. Prints a JSON summary and writes ``<out>/summary.json``::

    python -m tools.experiments.sac_learning --variant noise --out /tmp/noise_sac --train-s 220
    python -m tools.experiments.sac_learning --variant residual --out /tmp/residual_sac --episodes 300

Why these settings (``ALGO_O``): DSRL needs a base that already sometimes succeeds (hence the
weak base, not a random one); the 0/1 outcome drowned in the entropy bonus until
``backup_entropy=false`` with a small fixed-start temperature; two actors double the episodes
per minute at about the same update rate. Why a residual and not SAC on the L1 head itself: the
base VLA stays intact (frozen; ``residual_scale`` bounds how far any action departs from it,
which makes it safe on a robot), and the L1 head is a deterministic regression with no
likelihood for SAC's entropy term. Results, with dates and machines: docs/learning.md; the gated
tests tests/test_noise_sac_learning.py and tests/test_residual_sac_learning.py run steps 1-5.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("noise", "residual")
ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4
_SAC_O = ["algo.learning_starts=200", "algo.batch_size=64", "algo.utd_ratio=4", "algo.critic_hidden_dims=[128,128]",
          "algo.publish_every=10", "algo.max_update_ratio=0.5", "algo.backup_entropy=false",
          "algo.init_temperature=0.005", "algo.actor_lr=1e-3", "algo.critic_lr=1e-3", "algo.tau=0.02"]
#: the learner's algo.* overrides per variant (the module docstring says how they were found)
ALGO_O = {"noise": [*_SAC_O, "algo.noise_actor_hidden_dims=[128,128]", "algo.noise_scale=1.5",
                    "algo.noise_dims=action"],
          "residual": [*_SAC_O, "algo.residual_actor_hidden_dims=[128,128]", "algo.residual_scale=0.5"]}
#: per variant: (demo episodes, base steps, online episodes (0: --train-s), --train-s)
DEFAULTS = {"noise": (30, 250, 0, 480.0), "residual": (10, 80, 300, 600.0)}
#: the learner's store per variant (the residual proof writes no dataset)
_BUFFER_O = {"noise": ["buffer.video=false", "buffer.commit_interval_s=2"], "residual": ["buffer.persist=false"]}
#: the trained actor's name in the summary
_ACTOR = {"noise": "noise_actor", "residual": "residual"}


@dataclass(frozen=True)
class Base:
    """A weak base: the checkpoint, and (``residual``) its SFT trainable state."""

    ckpt: Path
    init: Path | None = None


def policy_overrides(variant: str, base: Base) -> list[str]:
    if variant == "noise":
        return ["policy=pi0", f"policy.checkpoint={base.ckpt}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=0",
                "policy.device=cpu", "policy.num_inference_steps=10"]
    o = ["policy=openvla_oft", f"policy.checkpoint={base.ckpt}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=8",
         "policy.device=cpu"]
    return o + ([f"policy.init_trainable={base.init}"] if base.init else [])


def _weak_pi0(out: Path, demos: Path, steps: int, *, lr: float = 3e-4, batch: int = 32, seed: int = 0,
              env_o: list[str] | None = None, arch: dict | None = None, image_size: int = 56,
              name: str = "pi0_weak") -> Base:
    """The tiny PI0 fitted by ``steps`` BC steps on the demos, saved in lerobot's layout as
    ``out/name`` (``env_o``: the env's overrides, default this module's ``ENV_O``; ``arch`` /
    ``image_size``: :func:`tools.make_tiny_checkpoints.make_pi0`'s; weights drawn from ``seed``)."""
    import shutil

    import torch

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, save_lerobot_checkpoint
    from agents.rs.agent import bc_inputs
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0
    from tools.record_demos import env_config

    spec = env_spec(env_config(ENV_O if env_o is None else env_o))
    raw = make_pi0(out / ("pi0_random" if name == "pi0_weak" else f"{name}_random"), spec, arch=arch, chunk_size=CHUNK, image_size=image_size, seed=seed)
    policy = Pi0Policy(Pi0PolicyConfig(checkpoint=str(raw), chunk_size=CHUNK, lora_rank=0, device="cpu"), spec)
    policy.inner.requires_grad_(True)
    policy.train()
    buf = load_demos(demos, spec.with_extras(policy.extras_spec()), seed=seed)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    torch.manual_seed(seed)
    for _ in range(steps):
        loss = policy.bc_loss(bc_inputs(buf.sample(batch, horizon=CHUNK)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    base = out / name
    save_lerobot_checkpoint(policy.inner, base, policy.arch, policy.stats)
    shutil.copytree(raw / "tokenizer", base / "tokenizer")
    return Base(base)


def _weak_oft(out: Path, demos: Path, steps: int, *, lr: float = 1e-3, seed: int = 0) -> Base:
    """The tiny OFT and its SFT trainable state: ``steps`` L1 steps on the demos."""
    import torch
    from safetensors.torch import save_file

    from agents.registry import build_policy
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.experiments.oft_grpo_demo import env_ranged_stats
    from tools.make_tiny_checkpoints import make_openvla_oft
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
    return Base(ckpt, init)


def make_weak_base(variant: str, out: Path, demos: Path, steps: int) -> Base:
    """The variant's weak base in ``out``, fitted by ``steps`` steps on the demos."""
    return (_weak_pi0 if variant == "noise" else _weak_oft)(out, demos, steps)


def sac_policy(variant: str, base: Base, algo: list[str]):
    """The frozen weak base wrapped with a fresh actor of the variant, as the learner builds it."""
    from hydra import compose, initialize_config_dir

    from agents import registry
    from envs.registry import env_spec

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="learner", overrides=[*ENV_O, *policy_overrides(variant, base), f"algo=sac_{variant}",
                                                         *algo])
    builder = registry.build_builder(cfg.algo)
    return registry.build_trained_policy(builder, cfg.policy, env_spec(cfg.env)).eval()


def evaluate(policy, episodes: int, *, seed: int = 50_000, deterministic: bool = False) -> float:
    """Success rate over ``episodes`` resets with seeds seed, seed+1, ... (whole chunks run)."""
    from tools.experiments.learning_run import evaluate_policy
    from tools.record_demos import env_config

    return float(np.mean(evaluate_policy(policy, env_config(ENV_O), episodes, seed=seed,
                                         deterministic=deterministic)))


def train(variant: str, out: Path, base: Base, algo: list[str], reward: str = "dense", *, episodes: int = 0,
          max_s: float, poll_s: float = 5.0, actors: int = 2) -> dict:
    """Learner + ``actors`` remote actors as processes until the learner counts ``episodes``
    online episodes (0: until ``max_s``; ``max_s`` also caps a stuck run), then SIGINT (the
    learner checkpoints). Returns the learner's last status and its online success trace."""
    from tools.experiments.learning_run import free_port, read_status, start_processes, stop_processes, watch

    run = out / "run"
    port, pub = free_port(), free_port()
    common = [*ENV_O, f"env.dense_reward={str(reward == 'dense').lower()}", *policy_overrides(variant, base),
              f"run_dir={run}", f"transport.port={port}", f"transport.pub_port={pub}", "transport.timeout_s=5.0",
              "transport.heartbeat_s=0.5"]
    run.mkdir(parents=True, exist_ok=True)
    procs = start_processes(run, common, [("learner", "learner", [
        f"algo=sac_{variant}", *algo, "device=cpu", "logging.wandb=disabled", "logging.every_s=5",
        "trainer.num_threads=1", *_BUFFER_O[variant]])])
    time.sleep(3.0)  # the learner binds before the actors connect
    procs += start_processes(run, common, [
        (f"actor{i}", "actor", [f"actor_id=a{i}", "spool.fsync=false", "log_every_s=10", f"seed={i}"])
        for i in range(actors)])
    trace, t0, status = [], time.monotonic(), {}

    def done(st: dict, t: float) -> bool:
        if not st:
            return False
        trace.append({"t_s": round(t), "episodes": st.get("episodes"), "success_window": st.get("success"),
                      "updates": st.get("updates"), "env_steps": st.get("env_steps"),
                      "load1": round(os.getloadavg()[0], 1)})
        print(json.dumps(trace[-1]), flush=True)
        return bool(episodes) and (st.get("episodes") or 0) >= episodes

    try:
        status = watch(procs, run, max_s=max_s, poll_s=poll_s, done=done)
    finally:
        stop_processes(list(reversed(procs)), 120)
    status = read_status(run) or status
    return {"status": status, "trace": trace, "wall_s": time.monotonic() - t0, "run_dir": str(run)}


def trained_policy(variant: str, base: Base, run_dir: Path, algo: list[str]):
    """(the frozen base with the learner's last checkpointed actor, the fresh actor's state, path)."""
    from learner.checkpoint import latest_checkpoint, load_checkpoint

    policy = sac_policy(variant, base, algo)
    fresh = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise RuntimeError(f"no checkpoint in {run_dir}/checkpoints (did the learner update?)")
    policy.load_trainable_state_dict(load_checkpoint(path)["algo"]["agent"]["policy"])
    return policy, fresh, path


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--demos", type=int, default=None, help="scripted demo episodes for the weak base "
                                                           "(default: noise 30, residual 10)")
    ap.add_argument("--base-steps", type=int, default=None, help="steps that make the weak base: noise's BC, "
                                                                 "residual's L1 SFT (default: 250, 80)")
    ap.add_argument("--eval-episodes", type=int, default=50, help="fixed seeds 50000... for before and after")
    ap.add_argument("--episodes", type=int, default=None, help="stop training at this many online episodes "
                                                               "(0: at --train-s; default: noise 0, residual 300)")
    ap.add_argument("--train-s", type=float, default=None, help="time cap of training (default: 480, 600)")
    ap.add_argument("--actors", type=int, default=2, help="actor processes (remote; the learner batches their acts)")
    ap.add_argument("--reward", choices=("dense", "sparse"), default="dense",
                    help="the env's own reward the learner trains on: dense (1 on success, else minus the "
                         "distance) or sparse (0/1); success is always the outcome")
    ap.add_argument("--algo", nargs="*", default=None, help="algo.* overrides of the learner (default: ALGO_O)")
    args = ap.parse_args(argv)
    demos, steps, episodes, train_s = DEFAULTS[args.variant]
    for k, v in (("demos", demos), ("base_steps", steps), ("episodes", episodes), ("train_s", train_s),
                 ("algo", ALGO_O[args.variant])):
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    import torch

    from tools.record_demos import env_config, record_demos

    torch.set_num_threads(1)
    v, out = args.variant, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    demos = out / "demos"
    if not demos.exists():
        record_demos(env_config(ENV_O), demos, args.demos, seed=1000)
    weak = out / "pi0_weak"  # a noise run's base is kept and reused in the same --out
    base = Base(weak) if v == "noise" and weak.exists() else make_weak_base(v, out, demos, args.base_steps)
    fresh = sac_policy(v, base, args.algo)
    n, actor = args.eval_episodes, _ACTOR[v]
    before = {"base": evaluate(fresh.base, n, deterministic=True)}
    if v == "noise":  # PI0 serves with N(0, I) noise; "base" is its zero-noise chunk
        before["base_sampled"] = evaluate(fresh.base, n)
    before[f"untrained_{actor}_mean"] = evaluate(fresh, n, deterministic=True)
    before[f"untrained_{actor}_sampled"] = evaluate(fresh, n)
    print("before", before, flush=True)
    setup_s = time.monotonic() - t0
    res = train(v, out, base, args.algo, args.reward, episodes=args.episodes, max_s=args.train_s,
                actors=args.actors)
    policy, _, path = trained_policy(v, base, Path(res["run_dir"]), args.algo)
    after = {f"{actor}_mean": evaluate(policy, n, deterministic=True), f"{actor}_sampled": evaluate(policy, n)}
    st = res["status"]
    summary = {"variant": v, "eval_episodes": n, "before": before, "after": after, "checkpoint": str(path),
               "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
               "updates": st.get("updates"), "policy_version": st.get("version"),
               "train_wall_s": round(res["wall_s"]), "setup_s": round(setup_s),
               "total_wall_s": round(time.monotonic() - t0), "algo": args.algo, "trace": res["trace"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: val for k, val in summary.items() if k != "trace"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
