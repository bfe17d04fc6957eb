"""GRPO on a tiny OpenVLA-OFT (discrete action tokens) learns ``env=point_reach`` (image +
state + instruction, 0/1 outcome), through the real learner and actor processes on
loopback, from a deliberately weak SFT policy: SimpleVLA-RL's recipe at toy scale.

1. a tiny OFT (:func:`tools.make_tiny_checkpoints.make_openvla_oft`, chunk 4 x 2 action
   tokens) with random weights, its dataset statistics set to the env's ranges (actions
   [-1, 1], state [0, 1]);
2. ``--demos`` scripted expert episodes (:func:`tools.record_demos.record_demos`) and
   ``--sft-steps`` steps of the token cross-entropy on them (:mod:`tools.sft`: LoRA + the
   action rows' LM head), written as ``policy.init_trainable``: the weak starting policy;
3. ``python -m learner algo=grpo policy=openvla_oft_discrete policy.init_trainable=<that>``
   plus ``--actors`` actor processes, for ``--minutes`` (or until the learner's windowed
   success reaches ``--target``);
4. success of the stored episodes by the policy version that acted in them (version 0: the
   SFT policy sampled at the training temperature), from the run's LeRobot dataset.

    python -m tools.experiments.oft_grpo_demo --out runs/oft_grpo --updates 60 --minutes 30

Prints a JSON summary and writes ``<out>/summary.json``. Extra learner overrides go after ``--``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

ENV_O = ["env=point_reach", "env.num_tasks=1", "env.randomize_targets=true", "env.state_has_target=true"]
CHUNK = 4
LORA_RANK = 8
#: the recipe (tests/test_oft_grpo_learning.py): 4 groups of 8 per update, 2 epochs of token-level
#: clipped ratios at lr 3e-4, every episode weighted alike. Bigger rounds (8 groups) or lr 1e-4
#: rose no better per episode in the same time (half the updates; docs/learning.md)
ALGO_O = ["algo=grpo", "algo.group_size=8", "algo.batch_groups=4", "algo.lr=3e-4", "algo.epochs=2",
          "algo.minibatch_size=32", "algo.loss_agg=episode_mean", "algo.job_timeout_s=60",
          "algo.round_timeout_s=120"]


def tiny_oft(folder: Path, spec, seed: int) -> Path:
    """The tiny OFT checkpoint folder (chunk ``CHUNK``, 32x32 images, weights drawn from ``seed``)
    with the env's ranges as its dataset statistics (:func:`env_ranged_stats`)."""
    from tools.make_tiny_checkpoints import make_openvla_oft

    ckpt = make_openvla_oft(folder, spec, chunk_size=CHUNK, image_size=32, seed=seed)
    env_ranged_stats(ckpt, spec.action_dim, spec.state_dim)
    return ckpt


def oft_policy_o(ckpt: Path, init: Path | None = None) -> list[str]:
    """The policy overrides of the tiny OFT at ``ckpt`` as the recipe trains it (LoRA ``LORA_RANK``,
    the proprio projector and the LM head), from the ``init`` trainable weights when given."""
    return ["policy=openvla_oft_discrete", f"policy.checkpoint={ckpt}", f"policy.chunk_size={CHUNK}",
            f"policy.lora_rank={LORA_RANK}", "policy.trainable_heads=[proprio_projector,model.language_model.lm_head]",
            "policy.device=cpu", "policy.value_head_dim=0", *([f"policy.init_trainable={init}"] if init else [])]


def env_ranged_stats(ckpt: Path, action_dim: int, state_dim: int) -> None:
    """point_reach's own ranges in the checkpoint's dataset_statistics.json (the tiny builder
    writes random ones, which would clip the expert's saturated actions)."""
    def st(n: int, lo: float, hi: float) -> dict:
        return {"mean": [(lo + hi) / 2] * n, "std": [(hi - lo) / 4] * n, "min": [lo] * n, "max": [hi] * n,
                "q01": [lo] * n, "q99": [hi] * n, "mask": [True] * n}

    p = ckpt / "dataset_statistics.json"
    d = json.loads(p.read_text())
    (key,) = d
    d[key]["action"], d[key]["proprio"] = st(action_dim, -1.0, 1.0), st(state_dim, 0.0, 1.0)
    p.write_text(json.dumps(d))


def main(argv: Sequence[str] | None = None) -> dict:
    from tools.experiments.learning_run import rl_minutes, run, run_args, start_out

    ap = run_args(__doc__, minutes=10.0, demos=10, target=0.95, window=64)
    ap.add_argument("--sft-steps", type=int, default=300)
    a = ap.parse_args(argv)
    out = start_out(a.out)
    from envs.registry import env_spec
    from tools import sft
    from tools.record_demos import env_config, record_demos

    t0 = time.monotonic()
    env_cfg = env_config(ENV_O)
    spec = env_spec(env_cfg)
    ckpt = tiny_oft(out / "oft", spec, a.seed)
    record_demos(env_cfg, out / "demos", a.demos, seed=1000)
    policy_o = [*ENV_O, *oft_policy_o(ckpt)]
    init = out / "sft.safetensors"
    weak = sft.main(["--demos", str(out / "demos"), "--steps", str(a.sft_steps), "--lr", "5e-3",
                     "--out", str(init), "--eval-episodes", "20", "--seed", str(a.seed), *policy_o, "device=cpu"])
    weak["prep_s"] = round(time.monotonic() - t0, 1)
    print("weak SFT policy:", json.dumps(weak), flush=True)
    algo = [*ALGO_O, *a.overrides]
    res = run(out, [*policy_o, f"policy.init_trainable={init}"], algo, minutes=rl_minutes(a, t0), actors=a.actors,
              updates=a.updates,
              target=a.target, window=a.window, seed=a.seed)
    summary = {"sft": weak, **res}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
