"""The policy's training-time calls behind one module (:class:`PolicyCalls`, what
``accelerator.prepare`` wraps for PPO and GRPO) and the batch helpers of their updates."""

from __future__ import annotations

import torch
from torch import nn

from agents.base import Batch
from agents.parallel import low_precision_autocast
from data.core.schema import EXTRA_PREFIX, TASK


class PolicyCalls(nn.Module):
    """The policy's training-time calls (and a separate value net's) behind one ``forward``,
    so that they run through the one module ``accelerator.prepare`` returns (DDP hooks,
    sharded engine). ``what`` names one call or a tuple of calls made in that order in
    *one* forward (DDP reduces once per forward/backward pair):
    ``"log_prob"`` (obs, actions) -> [B]; ``"token_log_prob"`` -> [B, T]; ``"sample"`` -> (actions, log_prob);
    ``"value"`` -> value [B] (the value net's when there is one, else the policy's).

    Why one wrapper for policy and value net: accelerate prepares one model per sharded
    engine, and under DDP one forward per backward keeps the reducer's bookkeeping simple."""

    def __init__(self, policy: nn.Module, value: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value = value

    def _call(self, what: str, obs: Batch, actions: torch.Tensor | None):
        if what == "log_prob":
            return self.policy.log_prob(obs, actions)
        if what == "token_log_prob":
            return self.policy.token_log_prob(obs, actions)
        if what == "sample":
            return self.policy.sample(obs)
        if what == "value":
            return self.value(obs) if self.value is not None else self.policy.value(obs)
        raise ValueError(f"unknown call {what!r}")

    def forward(self, obs: Batch, actions: torch.Tensor | None = None, what="log_prob"):
        # a sharded bf16 engine casts this module's weights to bf16 while the batch stays
        # float32: compute under autocast then (no-op for policies that hold bf16 already)
        with low_precision_autocast(self):
            if isinstance(what, str):
                return self._call(what, obs, actions)
            return tuple(self._call(w, obs, actions) for w in what)


def observation_keys(batch: Batch) -> list[str]:
    """The keys of ``batch`` a policy reads: ``observation.*``, ``task`` and the chunk's policy
    extras ``extra.*`` (PI0's denoising chain, which its ``log_prob`` recomputes)."""
    return [k for k in batch if k.startswith(("observation.", EXTRA_PREFIX)) or k == TASK]


def take(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of every tensor and list in ``batch``."""
    rows: list[int] | None = None
    out: Batch = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.index_select(0, idx.to(v.device))
        else:
            rows = idx.tolist() if rows is None else rows
            out[k] = [v[i] for i in rows]
    return out


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
