"""The MLP policy -> ``model.safetensors`` (its state dict) + ``config.json`` (everything needed
to rebuild the net and feed it): a plain format for a deployment stack of its own.

``config.json``::

    {"format": "tandem_mlp", "version": 1,
     "class": "agents.policies.mlp.MLPPolicy",
     "policy": {MLPPolicyConfig fields: hidden_dims, cnn_channels, image_encoder, chunk_size, ...},
     "spec": {"state_dim", "action_dim", "cameras": {name: [H, W, 3]}},
     "inputs": {key: {"dtype", "shape", "normalization"}}, "output": {...}}

Rebuilt with ``MLPPolicy(MLPPolicyConfig(**policy), EnvSpec(**spec))`` and
``load_state_dict(safetensors.torch.load_file("model.safetensors"))``. Normalisation: the state
goes in raw (as the env gives it), camera images as uint8 [B, H, W, 3] (the net divides by 255
and subtracts 0.5); the output is tanh-squashed into [-1, 1] (the env maps [-1, 1] affinely to
its actuator bounds), the deterministic action being tanh of the Gaussian's mean.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tools.export.source import ExportError


def mlp_config(policy) -> dict:
    spec = policy.spec
    inputs = {"observation.state": {"dtype": "float32", "shape": [spec.state_dim], "normalization": "none (raw env state)"}}
    for cam, (h, w, c) in sorted(spec.cameras.items()):
        inputs[f"observation.images.{cam}"] = {"dtype": "uint8", "shape": [h, w, c],
                                               "normalization": "x / 255 - 0.5, channels first (inside the net)"}
    return {"format": "tandem_mlp", "version": 1, "class": "agents.policies.mlp.MLPPolicy",
            "policy": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(policy.cfg).items()},
            "spec": {"state_dim": spec.state_dim, "action_dim": spec.action_dim,
                     "cameras": {k: list(v) for k, v in spec.cameras.items()}},
            "inputs": inputs,
            "output": {"action": {"dtype": "float32", "shape": [policy.chunk_size, policy.action_dim], "range": [-1, 1],
                                  "normalization": "tanh-squashed Gaussian; deterministic: tanh(mean); the env maps "
                                                   "[-1, 1] affinely to its actuator bounds"}}}


def export_mlp(policy, out: Path) -> dict:
    """Write ``policy`` (Tandem's MLP policy) as model.safetensors + config.json at ``out``."""
    from safetensors.torch import save_file

    from agents.policies.mlp import MLPPolicy

    if not isinstance(policy, MLPPolicy):
        raise ExportError(f"--format mlp writes the MLP policy; this is {type(policy).__name__}")
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in policy.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(mlp_config(policy), indent=2))
    return {"loader": "safetensors.torch.load_file into MLPPolicy(MLPPolicyConfig(**policy), EnvSpec(**spec))"}
