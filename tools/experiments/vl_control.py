"""The control of ``env=point_reach_vl`` (docs/preregistered.md, claim 1): behaviour cloning of
the same scripted demos by a policy that sees the state alone and by one that also sees the
image and reads the instruction, each then run on the held-out episodes.

- ``state``: the MLP on the agent's (x, y) alone (the env without its camera; the MLP has no
  instruction reader unless asked for one);
- ``vl``: the MLP with its CNN image encoder and the instruction encoder
  (``policy.task_embed_dim``), the policy of :mod:`tools.experiments.rs_vl_learning`;
- ``image`` (``--kinds``; not part of the registered claim): the same without the instruction
  encoder, so it sees both targets but not which one is meant.

Both are fitted with :func:`tools.sft.sft` (the policy's own ``bc_loss``) on demos recorded from
reset seeds ``DEMO_SEED + i`` and evaluated deterministically on the held-out reset seeds of
:data:`tools.experiments.rs_vl_learning.HELD_OUT_SEED`::

    python -m tools.experiments.vl_control --out /tmp/vl_control --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tools.experiments.rs_vl_learning import ENV_O, HELD_OUT, HELD_OUT_SEED, POLICY_O

STATE_ENV_O = [*ENV_O, "~env.cameras", "+env.cameras={}"]
STATE_POLICY_O = ["policy=mlp", "policy.hidden_dims=[64,64]", "+policy.log_std_max=-1.0",
                  "+policy.log_std_min=-3.0"]
KINDS = {"state": (STATE_ENV_O, STATE_POLICY_O), "vl": (ENV_O, POLICY_O),
         "image": (ENV_O, [o for o in POLICY_O if "task_embed_dim" not in o])}
DEMOS = 100
DEMO_SEED = 1000
STEPS = 1000


def record(out: Path, kind: str, episodes: int = DEMOS) -> Path:
    """The scripted demos for ``kind``'s env (the same episodes for both kinds: rendering
    draws nothing from the env's RNG); reused when present."""
    from tools.record_demos import env_config, record_demos

    d = out / f"demos_{'state' if kind == 'state' else 'image'}_{episodes}"
    if not d.exists():
        record_demos(env_config(KINDS[kind][0]), d, episodes, seed=DEMO_SEED)
    return d


def bc_held_out(out: Path, kind: str, *, seed: int = 0, demos: int = DEMOS, steps: int = STEPS,
                lr: float = 3e-3, episodes: int = HELD_OUT) -> dict:
    """BC of ``kind`` on the demos, then its held-out success (deterministic)."""
    import torch

    from agents.registry import build_policy
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.experiments.learning_run import evaluate_policy
    from tools.sft import learner_config, sft

    path = record(out, kind, demos)
    env_o, policy_o = KINDS[kind]
    cfg = learner_config([*env_o, *policy_o])
    spec = env_spec(cfg.env)
    torch.manual_seed(seed)
    policy = build_policy(cfg.policy, spec)
    buf = load_demos(path, spec, seed=seed)
    t0 = time.monotonic()
    losses = sft(policy, buf, steps=steps, batch_size=64, lr=lr, lr_min=1e-4, log_every=0)
    fit_s = time.monotonic() - t0
    policy.eval()
    wins = evaluate_policy(policy, cfg.env, episodes, seed=HELD_OUT_SEED, deterministic=True)
    return {"kind": kind, "seed": seed, "demos": demos, "transitions": len(buf), "steps": steps,
            "loss_first": losses[0], "loss_last": losses[-1], "fit_s": round(fit_s, 1),
            "held_out_success": sum(wins) / len(wins), "held_out_episodes": len(wins)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--demos", type=int, default=DEMOS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["state", "vl"])
    args = ap.parse_args(argv)
    torch_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for kind in args.kinds:
            r = bc_held_out(out, kind, seed=seed, demos=args.demos, steps=args.steps)
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def torch_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


if __name__ == "__main__":
    main()
