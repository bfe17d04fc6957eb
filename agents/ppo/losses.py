"""PPO's loss pieces on known inputs (:mod:`agents.ppo.agent` uses them; tests check them by hand).

Log-probabilities come at one of two levels (``PPOConfig.ratio_level``):

- per chunk, ``[N]``: one importance ratio per action chunk (the joint log-prob of the chunk);
- per token, ``[N, T]``: one ratio per factor of the chunk's likelihood (OpenVLA-OFT's
  K = chunk x A action tokens; a flow chain's per-step, per-action Gaussians), clipped each on
  its own and averaged over the real tokens (verl / SimpleVLA-RL's token-level PPO). A chunk's
  advantage, mask and weights ``[N]`` apply to all of its tokens.

A product of T ratios moves T times as fast as one of them, so with chunk-level ratios the
clip range is reached after a tiny per-token step and most of a batch's gradient is clipped
away (or, without clipping, the ratio explodes); token-level ratios keep each factor's step
bounded on its own.
"""

from __future__ import annotations

import torch

from agents.common.advantages import masked_mean


def per_token(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A per-chunk tensor [N] broadcast to ``like``'s shape ([N] or [N, T]); None, and a tensor
    of ``like``'s shape already (a token mask), stay as they are."""
    if x is None or like.ndim == 1 or x.shape == like.shape:
        return x
    return x.reshape(-1, *([1] * (like.ndim - 1))).expand_as(like)


#: log-ratios are clamped to this magnitude before ``exp`` (e^20 ~ 5e8: far past any clip)
LOG_RATIO_MAX = 20.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                clip_low: float, clip_high: float, mask: torch.Tensor | None = None,
                is_weight: torch.Tensor | None = None, dual_clip: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate: mean of w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with r = exp(logp - old_logp) and w the importance weight (1 when None); with ``dual_clip``
    c, a term with A < 0 is capped at -A c. ``logp`` / ``old_logp`` are [N] (chunk level) or
    [N, T] (token level: ``adv``, ``mask`` and ``is_weight`` [N] are each chunk's, for all
    of its tokens, and the mean is over the real tokens).

    A ratio above 1 + clip_high with A > 0 (or below 1 - clip_low with A < 0) gets no gradient;
    on the other side the unclipped term is kept. Metrics (detached): ``clip_frac`` (share of
    samples where the clipped term is active), ``approx_kl`` (k3 estimate of KL(old || new)),
    ``ratio_mean``.
    """
    adv, mask, is_weight = (per_token(t, logp) for t in (adv, mask, is_weight))
    # within +-LOG_RATIO_MAX the ratio is exact; beyond it (a stored log-prob far from the
    # policy's) exp would overflow to inf and the loss to inf or NaN
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    ratio = log_ratio.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per = torch.maximum(pg1, pg2)
    capped = None
    if dual_clip is not None:  # A < 0: at most -A * dual_clip (no gradient beyond it)
        capped = (adv < 0) & (per > -adv * dual_clip)
        per = torch.where(capped, -adv * dual_clip, per)
    if is_weight is not None:
        per = per * is_weight
    loss = masked_mean(per, mask)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((pg2 > pg1).float(), mask),
                   "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
                   "ratio_mean": masked_mean(ratio, mask)}
        if capped is not None:
            metrics["dual_clip_frac"] = masked_mean(capped.float(), mask)
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               value_clip: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """0.5 * mean of max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), all [N]; plain
    0.5 * mean (v - R)^2 when ``value_clip`` is None."""
    err = (values - returns).pow(2)
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        err = torch.maximum(err, (clipped - returns).pow(2))
    return 0.5 * masked_mean(err, mask)


def entropy_bonus(log_prob: torch.Tensor, mask: torch.Tensor | None = None, *,
                  score_function: bool = False) -> torch.Tensor:
    """Monte-Carlo entropy estimate -mean(log pi(a)) over actions a drawn from the policy [N].

    With reparameterised samples (``log_prob`` differentiable through the action) its gradient
    is the entropy's. For fixed actions (rollout data) pass ``score_function=True``: same
    value, gradient -mean((log pi - mean log pi) * grad log pi), the score-function estimate.
    """
    est = -masked_mean(log_prob, mask)
    if not score_function:
        return est
    lp = log_prob.detach()
    surrogate = masked_mean((lp + est.detach()) * (log_prob - lp), mask)
    return est.detach() - surrogate


def truncated_is_weights(behaviour_logp: torch.Tensor, old_logp: torch.Tensor,
                         cap: float | None) -> torch.Tensor:
    """Staleness correction [N]: min(exp(old_logp - behaviour_logp), cap), detached."""
    w = (old_logp - behaviour_logp).detach().clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX).exp()
    return w if cap is None else w.clamp(max=cap)
