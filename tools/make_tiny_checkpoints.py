"""Build tiny, architecturally faithful checkpoints and tokenizers, offline.

Nothing can be downloaded on the machines Tandem is built and tested on, so tests and the
CPU smoke bench use models with the real classes and the published file layouts at toy
sizes, with random weights:

- PI0 / PI0.5 in lerobot's layout: ``config.json`` (lerobot's own serialisation) +
  ``model.safetensors`` + ``tandem_arch.json`` (the reduced sizes) + normaliser
  statistics + ``tokenizer/`` (a small Gemma-style BPE tokenizer);
- OpenVLA-OFT in the published layout: HF ``config.json`` (model_type openvla, timm ids,
  Llama text_config) + ``model.safetensors`` + ``action_head--<step>_checkpoint.pt`` and
  ``proprio_projector--<step>_checkpoint.pt`` (or ``.safetensors``) +
  ``dataset_statistics.json`` + a small Llama-style tokenizer.

    python -m tools.make_tiny_checkpoints --out /tmp/tiny      # all of them
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from agents.policies.tokenizers import CORPUS, build_tokenizer  # noqa: F401 (tools import them here)
from data.core.spec import EnvSpec

TINY_PI0_ARCH = dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8,
                     expert_width=32, expert_mlp_dim=64, vocab_size=512, vision_width=32,
                     vision_depth=1, vision_heads=2, vision_mlp_dim=64, vision_patch=14)


# -- PI0 / PI0.5 --------------------------------------------------------------------------------
def make_pi0(path: str | Path, spec: EnvSpec, *, variant: str = "pi0", arch: dict | None = None,
             chunk_size: int = 8, image_size: int = 56, seed: int = 0, stats: bool = True) -> Path:
    """A random PI0/PI0.5 in lerobot's checkpoint layout, with a tokenizer/ folder."""
    from agents.policies.pi0.policy import Pi0Arch, build_lerobot_pi, lerobot_config, save_lerobot_checkpoint

    a = Pi0Arch.from_dict(TINY_PI0_ARCH if arch is None else arch)
    lr_cfg = lerobot_config(variant, spec, chunk_size=chunk_size, n_action_steps=chunk_size,
                            image_resolution=(image_size, image_size), device="cpu", dtype="float32")
    inner = build_lerobot_pi(variant, lr_cfg, a, seed=seed)
    st = None
    if stats:
        g = torch.Generator().manual_seed(seed + 1)
        s, act = spec.state_dim, spec.action_dim
        st = {"observation.state.mean": torch.randn(s, generator=g) * 0.1,
              "observation.state.std": torch.rand(s, generator=g) + 0.5,
              "observation.state.q01": -torch.rand(s, generator=g) - 0.5,
              "observation.state.q99": torch.rand(s, generator=g) + 0.5,
              "action.mean": torch.zeros(act), "action.std": torch.full((act,), 0.5),
              "action.q01": -torch.ones(act), "action.q99": torch.ones(act)}
    out = save_lerobot_checkpoint(inner, path, a, st)
    build_tokenizer(out / "tokenizer", kind="gemma", vocab_size=min(400, a.vocab_size))
    return out


# -- OpenVLA-OFT ----------------------------------------------------------------------------------
TINY_OFT_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=512, pad_token_id=448,
                     max_position_embeddings=512)
TINY_OFT_TIMM = ({"embed_dim": 32, "depth": 2, "num_heads": 2},
                 {"embed_dim": 32, "depth": 2, "num_heads": 2})


def make_openvla_oft(path: str | Path, spec: EnvSpec, *, chunk_size: int = 8, image_size: int = 56,
                     text_config: dict | None = None, timm_overrides=TINY_OFT_TIMM, head_format: str = "pt",
                     step: int = 100, seed: int = 0) -> Path:
    """A random OpenVLA-OFT in the published layout (config.json, model.safetensors,
    ``action_head--<step>_checkpoint.pt`` / ``proprio_projector--...`` with the DDP
    ``module.`` prefix, dataset_statistics.json) plus a Llama-style tokenizer.
    ``head_format="safetensors"`` writes the head files as safetensors instead (what
    Tandem prefers to write)."""
    import json

    from safetensors.torch import save_file

    from agents.policies.openvla_oft.prismatic import L1RegressionActionHead, OpenVLA, PrismaticConfig, ProprioProjector

    text = dict(TINY_OFT_TEXT if text_config is None else text_config)
    cfg = PrismaticConfig(image_sizes=(image_size, image_size), text_config=text,
                          pad_token_id=int(text["pad_token_id"]),
                          tandem_timm_overrides=tuple(timm_overrides) if timm_overrides else None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vla = OpenVLA(cfg, num_images=len(spec.cameras))
        d = vla.llm_dim
        head = L1RegressionActionHead(d, d, spec.action_dim, chunk_size)
        proprio = ProprioProjector(d, spec.state_dim)
    cfg.save(path / "config.json")
    save_file({k: v.contiguous() for k, v in vla.state_dict().items()}, str(path / "model.safetensors"))
    for name, mod in (("action_head", head), ("proprio_projector", proprio)):
        sd = {f"module.{k}": v.contiguous() for k, v in mod.state_dict().items()}
        if head_format == "pt":
            torch.save(sd, path / f"{name}--{step}_checkpoint.pt")
        else:
            save_file(sd, str(path / f"{name}--{step}_checkpoint.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)

    def stats(n: int, mask: list[bool]) -> dict:
        lo, hi = -torch.rand(n, generator=g) - 0.1, torch.rand(n, generator=g) + 0.1
        return {"mean": ((lo + hi) / 2).tolist(), "std": ((hi - lo) / 4).tolist(), "min": (lo * 1.2).tolist(),
                "max": (hi * 1.2).tolist(), "q01": lo.tolist(), "q99": hi.tolist(), "mask": mask}

    a = spec.action_dim
    (path / "dataset_statistics.json").write_text(json.dumps({"tiny_dataset": {
        "action": stats(a, [True] * (a - 1) + [False]), "proprio": stats(spec.state_dim, [True] * spec.state_dim),
        "num_transitions": 1, "num_trajectories": 1}}, indent=1))
    build_tokenizer(path, kind="llama", vocab_size=int(text["pad_token_id"]))
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write the checkpoints into")
    ap.add_argument("--state-dim", type=int, default=8)
    ap.add_argument("--action-dim", type=int, default=7)
    ap.add_argument("--image-size", type=int, default=64, help="env camera size (square)")
    args = ap.parse_args(argv)
    s = args.image_size
    spec = EnvSpec(state_dim=args.state_dim, action_dim=args.action_dim,
                   cameras={"image": (s, s, 3), "wrist_image": (s, s, 3)}, has_task=True)
    out = Path(args.out)
    jobs = [(v, lambda v=v: make_pi0(out / v, spec, variant=v)) for v in ("pi0", "pi05")]
    jobs += [(f"openvla_oft_{fmt}", lambda fmt=fmt: make_openvla_oft(out / f"openvla_oft_{fmt}", spec,
                                                                       head_format=fmt))
             for fmt in ("pt", "safetensors")]
    from tqdm import tqdm

    with tqdm(total=len(jobs), desc="tiny checkpoints", unit="ckpt", disable=None) as bar:
        for name, make in jobs:
            bar.set_postfix_str(name)
            path = make()
            bar.write(f"wrote {path}")
            bar.update(1)


if __name__ == "__main__":
    main()
