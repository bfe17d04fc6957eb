"""``tools.bench.train --cases oft_residual_sac``: one residual-SAC update (PLD style,
:mod:`agents.sac.residual`) with OpenVLA-OFT (L1 head) frozen, at ``--batch`` chunk windows.

Reported (p50 over ``--iters``):

- ``update_ms``: one :meth:`ResidualSACAgent.update` with ``utd_ratio`` 1 and no feature
  cache: the frozen features (and base chunks) of the batch's observations and next
  observations (one VLA pass over 2 x batch), one critic step and one actor + temperature step;
- ``features_ms``: the frozen VLA pass alone (what a fresh batch costs);
- ``critic_step_ms`` / ``actor_step_ms``: one step on a batch whose features are attached;
- ``updates_per_s`` (1000 / update_ms), ``critic_updates_per_s_cached`` (1000 /
  critic_step_ms: the rate once features are cached per observation, as the learner does);
- ``peak_gpu_gb``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def _batch(policy, spec, n: int, task: str):
    import torch

    from tools.bench.noise_sac import window_batch

    h = policy.chunk_size
    out = window_batch(spec, n, h, task)
    out["extra.residual"] = torch.rand(n, h, spec.action_dim) * 2 - 1
    return out


def bench_residual_sac(args, spec, tmp: Path) -> dict:
    import torch
    from accelerate import Accelerator

    from agents.sac.noise import attach_features
    from agents.sac.residual import ResidualSACAgent, ResidualSACConfig
    from agents.sac.residual_builder import ResidualSACBuilder
    from tools.bench.common import p50_p99, timed_ms
    from tools.bench.policy import build

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    base = build("openvla_oft", args.tiny, args.device, tmp, spec)[0]
    cfg = ResidualSACConfig(batch_size=args.batch, utd_ratio=1, critic_hidden_dims=(256, 256),
                            residual_actor_hidden_dims=(256, 256), num_critics=2, noise_feature_cache=0)
    nets = ResidualSACBuilder(cfg).make_networks(spec, base, torch.device(args.device))
    agent = ResidualSACAgent(cfg, nets.policy, spec.with_extras(nets.policy.extras_spec()),
                             Accelerator(cpu=not cuda, mixed_precision="no"), critic=nets.critic)
    policy = agent.policy
    res: dict = {"build_s": time.perf_counter() - t0, "chunk": policy.chunk_size, "batch": args.batch,
                 "feature_dim": policy.feature_dim, "residual_dims": policy.residual_actor.flat_dim,
                 "trainable_params_m": sum(p.numel() for p in policy.parameters() if p.requires_grad) / 1e6,
                 "frozen_params_m": sum(p.numel() for p in policy.base.parameters()) / 1e6}
    raw = _batch(policy, spec, args.batch, "pick up the cube")
    dev_batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in raw.items()}
    cached = attach_features(policy, dev_batch)

    def update():
        agent.update(iter([raw]))

    res["update_ms"] = p50_p99(timed_ms(update, args.iters, 1, sync))
    res["features_ms"] = p50_p99(timed_ms(lambda: attach_features(policy, dev_batch), args.iters, 1, sync))
    res["critic_step_ms"] = p50_p99(timed_ms(lambda: agent.critic_step(cached), args.iters, 1, sync))
    res["actor_step_ms"] = p50_p99(timed_ms(lambda: agent.actor_step(cached), args.iters, 1, sync))
    res["updates_per_s"] = 1000.0 / res["update_ms"]["p50"]
    res["critic_updates_per_s_cached"] = 1000.0 / res["critic_step_ms"]["p50"]
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    assert np.isfinite(res["update_ms"]["p50"])
    del agent, policy, base
    return res
