"""Compare LIBERO's camera images between two machines (renderers) on the same states.

A policy trained on images rendered by one machine (a GPU box's NVIDIA EGL) and evaluated on
another (a CPU machine's Mesa EGL or OSMesa) sees whatever the two renderers disagree on. This
renders LIBERO's fixed init states of a few tasks, after the settle steps and after a few steps of
the scripted expert, and saves every camera image; ``--compare`` reports how far another
machine's file lies from this one's, per camera, in 0-255 pixel values::

    python -m tools.render_probe --out gpu.npz                      # on the GPU box
    python -m tools.render_probe --out cpu.npz --compare gpu.npz    # here
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import numpy as np


def render(tasks: Sequence[int], init_states: Sequence[int], image_size: int, steps: int) -> dict[str, np.ndarray]:
    """Every camera image of each (task, init state) after reset and after ``steps`` expert steps."""
    from envs.libero.env import LiberoEnv

    images: dict[str, list[np.ndarray]] = {}
    for task in tasks:
        env = LiberoEnv("libero_spatial", task, init_state_id=0, image_size=image_size)
        try:
            for init in init_states:
                obs, _ = env.reset(seed=0, options={"init_state": init})
                frames = [obs]
                for _ in range(steps):
                    obs, *_ = env.step(env.expert_action())
                frames.append(obs)
                for frame in frames:
                    for key, value in frame.items():
                        if key.startswith("observation.images."):
                            images.setdefault(key, []).append(np.asarray(value))
        finally:
            env.close()
    return {key: np.stack(value) for key, value in images.items()}


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per camera: mean and max absolute difference (0-255) and the share of differing pixels."""
    out = {}
    for key in sorted(set(a) & set(b)):
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: shapes differ, {a[key].shape} against {b[key].shape}")
        diff = np.abs(a[key].astype(np.int16) - b[key].astype(np.int16))
        out[key] = {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
                    "share_differing": float((diff > 0).mean())}
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .npz to write this machine's images to")
    parser.add_argument("--compare", help="another machine's .npz: report the differences")
    parser.add_argument("--tasks", type=int, nargs="+", default=[0, 4, 9])
    parser.add_argument("--init-states", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="expert steps before the second image")
    args = parser.parse_args(argv)
    images = render(args.tasks, args.init_states, args.image_size, args.steps)
    np.savez_compressed(args.out, **images)
    report: dict = {"out": args.out, "cameras": {k: list(v.shape) for k, v in images.items()}}
    if args.compare:
        with np.load(args.compare) as other:
            report["difference"] = compare(images, dict(other))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
