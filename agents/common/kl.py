"""KL penalties between the trained policy and a reference, per sample, from log-probs.

Schulman's estimators of KL(pi || ref) from samples a ~ pi, with r = log ref(a) - log pi(a):

    k1 = -r                  unbiased, high variance, can be negative
    k2 = r^2 / 2             biased, low variance, non-negative
    k3 = exp(r) - r - 1      unbiased, low variance, non-negative (GRPO's "low_var_kl")

Inputs are log-probs [N] (or any matching shape); outputs have the same shape.
"""

from __future__ import annotations

import torch

#: |r| is clamped to this inside k3 so that exp(r) stays finite for chunk log-densities
MAX_LOG_RATIO = 20.0


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2."""
    return 0.5 * (logp - ref_logp).pow(2)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, *,
          max_log_ratio: float = MAX_LOG_RATIO) -> torch.Tensor:
    """k3 = exp(r) - r - 1 with r = log ref - log pi (clamped to +-max_log_ratio); >= 0."""
    r = (ref_logp - logp).clamp(-max_log_ratio, max_log_ratio)
    return r.exp() - r - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
#: accepted values of a config's ``kl_kind``
KL_KINDS = ("none", *KL_ESTIMATORS)


def kl_penalty(kind: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The per-sample penalty of ``kind`` ("k1", "k2", "k3"; "none" gives zeros)."""
    if kind == "none":
        return torch.zeros_like(logp)
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl kind {kind!r}; choose one of {KL_KINDS}")
    return KL_ESTIMATORS[kind](logp, ref_logp)
