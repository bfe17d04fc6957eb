"""Learning proof of noise-space SAC (DSRL) on a tiny PI0, through the real learner and actor.

1. Scripted demos of ``env=point_reach`` (one task, random target, one 32x32 camera, the
   target in the state; 0/1 outcome) from :func:`tools.record_demos.record_demos`.
2. A deliberately weak base: a tiny, architecturally faithful PI0
   (:func:`tools.make_tiny_checkpoints.make_pi0`, chunk 4) fitted by a few flow-matching BC
   steps on those demos (every weight trained), saved as a lerobot checkpoint.
3. Before: the frozen base evaluated in-process on ``--eval-episodes`` fixed seeds
   (stochastic: N(0, I) noise, as it serves; deterministic: zero noise).
4. ``python -m learner algo=sac algo.action_space=noise policy=pi0 policy.checkpoint=<base>``
   and one ``python -m actor`` (remote) as processes on loopback for ``--train-s`` seconds.
5. After: the learner's final checkpoint (the noise actor) around the same frozen base,
   evaluated on the same seeds (deterministic: the actor's mean noise; stochastic: sampled).

Prints a JSON summary (before/after success, online episodes, updates, wall time, and the
learner's windowed online success over time) and writes it to ``<out>/summary.json``::

    python -m tools.noise_sac_learning --out /tmp/noise_sac --train-s 480

Measured (shared 2-core CPU at load 4-10; 5 demos, 100 BC steps, 40 evaluation episodes on
seeds 50000..50039): STILL NO RELIABLE LEARNING. Earlier runs (old defaults: entropy backup,
temperature 0.05, lr 3e-4): base 0.125 / 0.075, after 0.05-0.10 (139 and 405 episodes).

Diagnosis (in-process scripts outside the repo, same update functions):
- the base CAN be steered: for fixed observations the executed action's std over N(0, I)
  noises is 0.45 (|a| mean 0.46), and a best-of-N oracle (pick the noise whose chunk ends
  nearest the target) succeeds 0.45 (N=8) and 0.62 (N=32) against 0.05 (N=1), with the
  padded noise dims zero (``noise_dims=action``); 0.47 / 0.68 with all dims. The 100-step
  base itself points nowhere (cosine of its chunk with the target direction: -0.17): the
  noise decides everything, so the actor has to learn the whole reach from sparse reward;
- the features are fine for this setting: a linear probe of (target - agent) from them has
  held-out R^2 1.0 (via the state part); their pooled image+instruction part alone: -0.18
  (mean pooling loses positions: an image-only task would need more);
- the old defaults drowned the 0/1 reward in the entropy bonus: Q means of ~5 against
  returns <= 1 (alpha 0.03 x entropy 8 per chunk, backed up). Fixed in the defaults below
  (``backup_entropy=false``, temperature 0.005, lr 1e-3, UTD 4): Q means now 0.3-0.6;
- ``noise_dims=all`` (128 noise values per chunk) learned less than ``action`` (8).
In-process with the new defaults (same update functions, features cached): run A, 200
episodes: online success (20-episode window) 0.05 -> 0.35, deterministic eval 0.10 -> 0.175;
run B (UTD 8, batch 128), 180 episodes: eval 0.10 -> 0.075, online 0.05-0.25; run C (a
400-BC-step base, no better: 0.075), 160 episodes: eval 0.075 -> 0.10.
Through the processes, this tool with the defaults below (``--eval-episodes 40 --train-s
600``; start-up took 270 s at load 10; 325 online episodes, 3985 updates, checkpoint at
update 2910; 1045 s in all): before 0.05 (base, N(0, I) noise), 0.10 (zero noise), 0.10
(untrained actor, sampled); after 0.15 (actor mean), 0.25 (sampled). 4 -> 10 wins of 40:
a first positive signal, NOT significant (p ~ 0.07), and the online window stayed
0.05-0.2. The likely limit is the signal: ~10% of ~200-300 episodes succeed, a few dozen
positive chunks, too few to learn a direction map from scratch. Next: a base that already
sometimes succeeds (the DSRL premise; more demos, not more BC steps), more episodes, a
larger eval (100+ episodes), or a 0/1-preserving shaped reward.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy_overrides(ckpt: Path) -> list[str]:
    return ["policy=pi0", f"policy.checkpoint={ckpt}", f"policy.chunk_size={CHUNK}", "policy.lora_rank=0",
            "policy.device=cpu", "policy.num_inference_steps=10"]


def make_weak_base(out: Path, demos: Path, steps: int, *, lr: float = 3e-4, batch: int = 32, seed: int = 0) -> Path:
    """The tiny PI0 fitted by ``steps`` BC steps on the demos, saved in lerobot's layout."""
    import shutil

    import torch

    from agents.policies.pi0 import Pi0Policy, Pi0PolicyConfig, save_lerobot_checkpoint
    from agents.rejection_sampling import bc_inputs
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0
    from tools.record_demos import env_config

    spec = env_spec(env_config(ENV_O))
    raw = make_pi0(out / "pi0_random", spec, chunk_size=CHUNK, seed=seed)
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
    base = out / "pi0_weak"
    save_lerobot_checkpoint(policy.inner, base, policy.arch, policy.stats)
    shutil.copytree(raw / "tokenizer", base / "tokenizer")
    return base


def evaluate(policy, episodes: int, *, seed: int = 50_000, deterministic: bool = False) -> float:
    """Success rate over ``episodes`` resets with seeds seed, seed+1, ... (whole chunks run)."""
    import torch

    from actor.loop import obs_arrays
    from envs.registry import make_env
    from tools.record_demos import env_config

    env = make_env(env_config(ENV_O))
    torch.manual_seed(seed)
    wins = 0
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            done, ok = False, False
            while not done:
                arrays, tasks = obs_arrays(obs)
                batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
                batch["task"] = tasks
                with torch.no_grad():
                    chunk = policy.act(batch, deterministic=deterministic).actions[0].numpy()
                for a in chunk:
                    obs, _, term, trunc, info = env.step(np.asarray(a, np.float32))
                    ok = bool(info.get("is_success", False))
                    if term or trunc:
                        done = True
                        break
            wins += ok
    finally:
        env.close()
    return wins / episodes


def train(out: Path, base: Path, train_s: float, algo: list[str]) -> dict:
    """Learner + one remote actor as processes for ``train_s`` seconds, then SIGINT (the
    learner checkpoints). Returns the learner's last status and its online success trace."""
    run = out / "run"
    port, pub = _free_port(), _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    common = [*ENV_O, *policy_overrides(base), f"run_dir={run}", f"transport.port={port}",
              f"transport.pub_port={pub}", "transport.timeout_s=5.0", "transport.heartbeat_s=0.5"]
    run.mkdir(parents=True, exist_ok=True)
    procs = []
    for module, args, log in (
            ("learner", ["algo=sac", "algo.action_space=noise", *algo, "device=cpu", "logging.wandb=disabled",
                         "logging.every_s=5", "trainer.num_threads=1", "buffer.video=false",
                         "buffer.commit_interval_s=2"], "learner.log"),
            ("actor", ["actor_id=a0", "spool.fsync=false", "log_every_s=10", "seed=0"], "actor.log")):
        f = open(run / log, "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *common, *args], cwd=ROOT, env=env,
                                      stdout=f, stderr=subprocess.STDOUT))
        time.sleep(3.0 if module == "learner" else 0.0)
    trace, t0, status = [], time.monotonic(), {}
    try:
        while time.monotonic() - t0 < train_s:
            time.sleep(10)
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[2]} exited {p.returncode}; see {run}")
            try:
                status = json.loads((run / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            trace.append({"t_s": round(time.monotonic() - t0), "episodes": status.get("episodes"),
                          "success_window": status.get("success"), "updates": status.get("updates"),
                          "env_steps": status.get("env_steps")})
            print(json.dumps(trace[-1]), flush=True)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
    status = json.loads((run / "status.json").read_text())
    return {"status": status, "trace": trace, "wall_s": time.monotonic() - t0, "run_dir": str(run)}


def trained_policy(base: Path, run_dir: Path, algo: list[str]):
    """The frozen base with the learner's last checkpointed noise actor."""
    from hydra import compose, initialize_config_dir

    from agents import registry
    from envs.registry import env_spec
    from learner.checkpoint import latest_checkpoint, load_checkpoint

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="learner", overrides=[*ENV_O, *policy_overrides(base), "algo=sac",
                                                         "algo.action_space=noise", *algo])
    builder = registry.build_builder(cfg.algo)
    policy = registry.build_trained_policy(builder, cfg.policy, env_spec(cfg.env)).eval()
    fresh = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise RuntimeError(f"no checkpoint in {run_dir}/checkpoints (did the learner update?)")
    policy.load_trainable_state_dict(load_checkpoint(path)["algo"]["agent"]["policy"])
    return policy, fresh, path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--demos", type=int, default=5, help="scripted demo episodes for the weak base")
    ap.add_argument("--bc-steps", type=int, default=100, help="BC steps that make the weak base")
    ap.add_argument("--eval-episodes", type=int, default=50)
    ap.add_argument("--train-s", type=float, default=480.0)
    ap.add_argument("--algo", nargs="*", default=[
        "algo.learning_starts=200", "algo.batch_size=64", "algo.utd_ratio=4", "algo.critic_hidden_dims=[128,128]",
        "algo.noise_actor_hidden_dims=[128,128]", "algo.publish_every=10", "algo.max_update_ratio=0.5",
        "algo.backup_entropy=false", "algo.init_temperature=0.005", "algo.actor_lr=1e-3", "algo.critic_lr=1e-3",
        "algo.tau=0.02", "algo.noise_scale=1.5", "algo.noise_dims=action"], help="algo.* overrides of the learner")
    args = ap.parse_args(argv)
    import torch

    from agents.policies.pi0 import Pi0Policy, Pi0PolicyConfig
    from envs.registry import env_spec
    from tools.record_demos import env_config, record_demos

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    demos = out / "demos"
    if not demos.exists():
        record_demos(env_config(ENV_O), demos, args.demos, seed=1000)
    base = out / "pi0_weak"
    if not base.exists():
        base = make_weak_base(out, demos, args.bc_steps)
    spec = env_spec(env_config(ENV_O))
    frozen = Pi0Policy(Pi0PolicyConfig(checkpoint=str(base), chunk_size=CHUNK, lora_rank=0, device="cpu"), spec).eval()
    n = args.eval_episodes
    before = {"base_stochastic": evaluate(frozen, n), "base_zero_noise": evaluate(frozen, n, deterministic=True)}
    print("before", before, flush=True)
    setup_s = time.monotonic() - t0
    res = train(out, base, args.train_s, args.algo)
    policy, fresh, ckpt = trained_policy(base, Path(res["run_dir"]), args.algo)
    after = {"noise_actor_mean": evaluate(policy, n, deterministic=True),
             "noise_actor_sampled": evaluate(policy, n)}
    policy.load_trainable_state_dict(fresh)
    before["untrained_noise_actor_sampled"] = evaluate(policy, n)
    st = res["status"]
    summary = {"eval_episodes": n, "before": before, "after": after, "checkpoint": str(ckpt),
               "online_episodes": st.get("episodes"), "env_steps": st.get("env_steps"),
               "updates": st.get("updates"), "policy_version": st.get("version"),
               "train_wall_s": round(res["wall_s"]), "setup_s": round(setup_s),
               "total_wall_s": round(time.monotonic() - t0), "algo": args.algo, "trace": res["trace"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "trace"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
