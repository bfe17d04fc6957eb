"""Diagnostics of finished :mod:`tools.experiments.residual_vl_learning` runs (not registered
measures), each on the held-out episodes:

- ``curve``: deterministic success of every kept residual checkpoint (one per 500 updates and
  the final one), in update order;
- ``sampled``: the final residual with sampled residuals (the actor's behaviour) instead of
  its mean;
- ``outcomes``: where the base (``start``) and the final residual go
  (:func:`tools.experiments.vl_outcomes.outcomes`: the instructed target, the other target
  first or instead, neither).

The more-BC control's weights are not kept by the tool, so it has none of these::

    python -m tools.experiments.residual_vl_outcomes /tmp/res_vl --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def diagnose(out: Path, seed: int, extra: tuple[str, ...] = ()) -> dict:
    """The diagnostics of seed ``seed``'s run in ``out`` (module docstring)."""
    from learner.checkpoint import load_checkpoint
    from tools.experiments.learning_run import evaluate_policy
    from tools.experiments.residual_vl_learning import (ENV_O, HELD_OUT, HELD_OUT_SEED, held_out, mlp,
                                                        residual_policy)
    from tools.experiments.vl_outcomes import outcomes
    from tools.sft import learner_config

    env = learner_config(ENV_O).env
    base = out / f"base_seed{seed}.safetensors"
    ckpts = sorted(p for p in (out / f"residual_seed{seed}" / "checkpoints").glob("step_*") if p.is_dir())
    curve, final = [], None
    for ck in ckpts:
        final = residual_policy(base, seed, load_checkpoint(ck)["algo"]["agent"]["policy"], extra)
        curve.append([int(ck.name.split("_")[1]), held_out(final)])
    if final is None:
        raise RuntimeError(f"{out}: no residual checkpoints of seed {seed}")
    wins = evaluate_policy(final, env, HELD_OUT, seed=HELD_OUT_SEED, deterministic=False)
    return {"seed": seed, "curve": curve, "sampled": sum(wins) / len(wins),
            "outcomes_start": outcomes(mlp(base=base), env, HELD_OUT, seed=HELD_OUT_SEED),
            "outcomes_residual": outcomes(final, env, HELD_OUT, seed=HELD_OUT_SEED)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out folder of residual_vl_learning")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("overrides", nargs="*", help="the run's extra learner overrides (after --)")
    args = ap.parse_args(argv)
    rows = []
    for seed in args.seeds:
        r = diagnose(Path(args.out), seed, tuple(args.overrides))
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


if __name__ == "__main__":
    main()
