"""``tools.bench.train --cases pi0_noise_sac``: one noise-space SAC update (DSRL,
:mod:`agents.sac.noise`) with PI0 frozen, at ``--batch`` chunk windows.

Reported (p50 over ``--iters``):

- ``update_ms``: one :meth:`NoiseSACAgent.update` with ``utd_ratio`` 1: the frozen features of
  the batch's observations and next observations (one backbone pass over 2 x batch), one
  critic step and one actor + temperature step;
- ``features_ms``: the frozen feature pass alone (what a fresh batch costs);
- ``critic_step_ms`` / ``actor_step_ms``: one step on a batch whose features are attached;
- ``updates_per_s`` (1000 / update_ms) and ``critic_updates_per_s_cached`` (1000 /
  critic_step_ms: the rate once features are cached, e.g. in the replay buffer);
- ``critic_updates_per_env_step_at_10hz``: critic updates one GPU sustains per env step for
  a 10 Hz robot with one fresh batch per update (``updates_per_s / 10``);
- ``peak_gpu_gb``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def window_batch(spec, n: int, h: int, task: str) -> dict:
    """A replay batch of ``n`` random chunk windows of ``h`` steps (obs, next obs, action,
    reward, masks), without the algorithm's stored extra."""
    import torch

    from tools.bench.common import random_obs

    out = {}
    for pre, seed in (("", 0), ("next.", 1)):
        obs = random_obs(spec.state_dim, spec.cameras, n, seed=seed)
        out.update({pre + k: torch.from_numpy(v) for k, v in obs.items()})
    out["task"] = [task] * n
    out["action"] = torch.rand(n, h, spec.action_dim) * 2 - 1
    out["reward"] = torch.zeros(n, h)
    out["step_mask"] = torch.ones(n, h, dtype=torch.bool)
    out["n_steps"] = torch.full((n,), h)
    out["terminated"] = torch.zeros(n, dtype=torch.bool)
    return out


def _batch(policy, spec, n: int, task: str):
    import torch

    h = policy.chunk_size
    out = window_batch(spec, n, h, task)
    out["extra.noise"] = torch.randn(n, h, policy.full_dims)
    return out


def bench_noise_sac(args, spec, tmp: Path) -> dict:
    import torch
    from accelerate import Accelerator

    from agents.sac.noise import NoiseSACAgent, attach_features
    from agents.sac.noise_builder import NoiseSACBuilder
    from agents.sac.noise import NoiseSACConfig
    from tools.bench.common import p50_p99, timed_ms
    from tools.bench.policy import build

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    base = build("pi0", args.tiny, args.device, tmp, spec)[0]
    cfg = NoiseSACConfig(batch_size=args.batch, utd_ratio=1, critic_hidden_dims=(256, 256),
                         noise_actor_hidden_dims=(256, 256), num_critics=2)
    builder = NoiseSACBuilder(cfg)
    nets = builder.make_networks(spec.with_extras(base.extras_spec()), base, torch.device(args.device))
    agent = NoiseSACAgent(cfg, nets.policy, nets.spec, Accelerator(cpu=not cuda, mixed_precision="no"),
                          critic=nets.critic)
    policy = agent.policy
    res: dict = {"build_s": time.perf_counter() - t0, "chunk": policy.chunk_size, "batch": args.batch,
                 "feature_dim": policy.feature_dim, "noise_dims": policy.noise_actor.flat_dim,
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
    res["critic_updates_per_env_step_at_10hz"] = res["updates_per_s"] / 10.0
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    assert np.isfinite(res["update_ms"]["p50"])
    del agent, policy, base
    return res
