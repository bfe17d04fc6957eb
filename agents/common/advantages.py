"""Advantage estimators for on-policy training (PPO, GRPO and relatives), side by side.

Each estimator is a small pure function returning ``(advantages, returns)``:

    gae(rewards, values, next_values, terminated, truncated, mask, gamma, lam)   [B, T] each
    grpo(scores, group_ids, norm_std=True)        [N]   outcome minus its group's mean (/ std)
    rloo(scores, group_ids)                       [N]   outcome minus the mean of the others
    remax(scores, baseline_scores)                [N]   outcome minus the greedy rollout's
    reinforce_pp(rewards, mask, gamma, kl=..., kl_coef=...)   [B, T]  whitened discounted returns

Per-step estimators (``gae``, ``reinforce_pp``) take padded segments: row b is one piece
of one or more episodes, column t its t-th step (for chunked policies: its t-th chunk), and
``mask`` [B, T] marks the real steps; padded steps get advantage and return 0. Outcome
estimators take one score per sample (an episode's success or return) and return
``returns = scores``; the caller broadcasts an episode's advantage to its chunks.

``dynamic_sampling_mask`` (DAPO) drops the groups whose outcomes are all equal: their
group-relative advantages are all zero and carry no gradient.
"""

from __future__ import annotations

from typing import Callable

import torch


# -- helpers ------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true (all entries when None); 0 when
    the mask is empty."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (std with Bessel's correction);
    masked-out entries become 0."""
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp_min(1.0)
    var = ((x - mean).pow(2) * m).sum() / (n - 1.0).clamp_min(1.0)
    return (x - mean) / (var.sqrt() + eps) * m


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index of each sample's group [N], group sizes [G], group means [G],
    group sums of squared deviations [G]) for arbitrary integer ``group_ids``."""
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    g = counts.numel()
    counts = counts.to(scores.dtype)
    mean = scores.new_zeros(g).index_add_(0, inv, scores) / counts
    ssd = scores.new_zeros(g).index_add_(0, inv, (scores - mean[inv]).pow(2))
    return inv, counts, mean, ssd


# -- per-step estimators ------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
        terminated: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded segments; all inputs [B, T].

    ``values[b, t]`` = V(s_t), ``next_values[b, t]`` = V(s_{t+1}) (of the step's own next
    observation: for a truncated step, the final observation of the episode). The TD error
    delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t) bootstraps on truncation
    and at segment ends that are not episode ends, never on termination. The recursion
    A_t = delta_t + gamma * lam * A_{t+1} stops at episode ends (terminated or truncated) and
    at the last real step of the segment. Returns (advantages [B, T], returns = A + V [B, T]),
    zero where ``mask`` is false.
    """
    dt = torch.promote_types(rewards.dtype, torch.float32)
    r, v, nv = rewards.to(dt), values.to(dt), next_values.to(dt)
    m = mask.to(dt)
    ended = (terminated.bool() | truncated.bool()).to(dt)
    # whether step t's advantage continues into step t+1 of the same row
    cont = torch.zeros_like(m)
    cont[:, :-1] = m[:, :-1] * m[:, 1:] * (1.0 - ended[:, :-1])
    delta = (r + gamma * (1.0 - terminated.to(dt)) * nv - v) * m
    adv = torch.zeros_like(delta)
    last = torch.zeros_like(delta[:, 0])
    for t in reversed(range(delta.shape[1])):
        last = delta[:, t] + gamma * lam * cont[:, t] * last
        adv[:, t] = last
    adv = adv * m
    return adv, (adv + v) * m


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *,
                 kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: critic-free discounted returns with the per-step KL penalty folded into
    the reward, whitened across the whole batch. Inputs [B, T] (row = one episode).

    r'_t = r_t - kl_coef * kl_t;  G_t = r'_t + gamma * G_{t+1} over the real steps;
    advantages = (G - mean(G)) / (std(G) + eps) over all real steps of the batch.
    Returns (advantages [B, T], G [B, T]), zero where ``mask`` is false.
    """
    dt = torch.promote_types(rewards.dtype, torch.float32)
    m = mask.to(dt)
    r = rewards.to(dt)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl.to(dt)
    r = r * m
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = (r[:, t] + gamma * running) * m[:, t]
        returns[:, t] = running
    return masked_whiten(returns, m, eps), returns


# -- outcome estimators -------------------------------------------------------------------------
def grpo(scores: torch.Tensor, group_ids: torch.Tensor, *, norm_std: bool = True,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage: (s_i - mean of its group) / (std of its group + eps), the
    std with Bessel's correction (as verl and TRL), skipped when ``norm_std`` is false
    (Dr. GRPO). ``scores`` [N] float, ``group_ids`` [N] int. A group of one gets 0.
    Returns (advantages [N], scores [N])."""
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    inv, counts, mean, ssd = _group_stats(s, group_ids)
    adv = s - mean[inv]
    if norm_std:
        std = (ssd / (counts - 1.0).clamp_min(1.0)).sqrt()
        adv = adv / (std[inv] + eps)
    return adv, s


def rloo(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: s_i minus the mean of the other members of its group,
    = n / (n - 1) * (s_i - group mean). ``scores`` [N], ``group_ids`` [N]. A group of one gets 0.
    Returns (advantages [N], scores [N])."""
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    inv, counts, mean, _ = _group_stats(s, group_ids)
    n = counts[inv]
    return (s - mean[inv]) * n / (n - 1.0).clamp_min(1.0), s


def remax(scores: torch.Tensor, baseline_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: s_i minus the score of the greedy (deterministic) rollout of the same job; the
    caller matches ``baseline_scores`` [N] to ``scores`` [N]. Returns (advantages [N], scores [N])."""
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    return s - baseline_scores.to(s.dtype), s


def dynamic_sampling_mask(scores: torch.Tensor, group_ids: torch.Tensor
                          ) -> tuple[torch.Tensor, int]:
    """DAPO's dynamic sampling: (keep [N] bool, number of dropped groups). A group is dropped
    when all its outcomes are equal (all success or all failure; a group of one too)."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    lo = s.new_full((g,), float("inf")).scatter_reduce(0, inv, s, "amin")
    hi = s.new_full((g,), float("-inf")).scatter_reduce(0, inv, s, "amax")
    varied = hi > lo
    return varied[inv], int((~varied).sum())


ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "remax": remax,
    "reinforce_pp": reinforce_pp,
}
#: estimators that need a value function
NEEDS_VALUES = frozenset({"gae"})
#: estimators over one outcome per episode, compared within groups of the same job
GROUP_ESTIMATORS = frozenset({"grpo", "rloo"})
