"""Advantage estimators (agents/common/advantages.py) and KL penalties (agents/common/kl.py) on small
inputs computed by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from agents.common.advantages import (ESTIMATORS, dynamic_sampling_mask, gae, grpo, masked_whiten,
                               reinforce_pp, remax, rloo)
from agents.common.kl import kl_k1, kl_k2, kl_k3, kl_penalty


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, t(b) if not isinstance(b, torch.Tensor) else b,
                               atol=tol, rtol=tol)


# -- GAE ----------------------------------------------------------------------------------------
def test_gae_termination_vs_truncation_in_the_middle():
    """Both rows end an episode at t=1 and start a new one at t=2; the segment then stops at
    t=3 without the episode ending. gamma = lam = 0.5, rewards 1, V(s_t) = 1, 2, 3, 4;
    next_values[1] = 10 is V(final observation)."""
    g = lam = 0.5
    rewards = torch.ones(2, 4)
    values = t([[1, 2, 3, 4]] * 2)
    next_values = t([[2, 10, 4, 5]] * 2)
    terminated = t([[0, 1, 0, 0], [0, 0, 0, 0]], torch.bool)
    truncated = t([[0, 0, 0, 0], [0, 1, 0, 0]], torch.bool)
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv, ret = gae(rewards, values, next_values, terminated, truncated, mask, g, lam)
    # deltas: t0 = 1 + .5*2 - 1 = 1; t2 = 1 + .5*4 - 3 = 0; t3 = 1 + .5*5 - 4 = -0.5 (bootstrapped)
    # t1 terminated: 1 - 2 = -1 (no bootstrap); t1 truncated: 1 + .5*10 - 2 = 4
    a3 = -0.5
    a2 = 0 + 0.25 * a3
    term = [1 + 0.25 * -1, -1, a2, a3]
    trunc = [1 + 0.25 * 4, 4, a2, a3]
    close(adv, [term, trunc])
    close(ret, t([term, trunc]) + values)


def test_gae_mask_pads_and_bootstraps_at_the_segment_end():
    """Row 0 has 2 real steps then padding (garbage values there must not leak); row 1 is full."""
    g, lam = 0.9, 0.8
    rewards = t([[1.0, 2.0, 100.0], [0.0, 0.0, 1.0]])
    values = t([[0.5, 1.0, 50.0], [0.1, 0.2, 0.3]])
    next_values = t([[1.0, 3.0, 70.0], [0.2, 0.3, 0.7]])
    terminated = t([[0, 0, 1], [0, 0, 1]], torch.bool)
    truncated = torch.zeros(2, 3, dtype=torch.bool)
    mask = t([[1, 1, 0], [1, 1, 1]], torch.bool)
    adv, ret = gae(rewards, values, next_values, terminated, truncated, mask, g, lam)
    a1 = 2.0 + g * 3.0 - 1.0                       # segment end: bootstraps from V(s_2) = 3
    a0 = (1.0 + g * 1.0 - 0.5) + g * lam * a1
    b2 = 1.0 - 0.3                                 # terminated: no bootstrap
    b1 = (0.0 + g * 0.3 - 0.2) + g * lam * b2
    b0 = (0.0 + g * 0.2 - 0.1) + g * lam * b1
    close(adv, [[a0, a1, 0.0], [b0, b1, b2]])
    close(ret, [[a0 + 0.5, a1 + 1.0, 0.0], [b0 + 0.1, b1 + 0.2, b2 + 0.3]])


def test_gae_with_lambda_one_is_the_discounted_return_minus_value():
    torch.manual_seed(0)
    r, v = torch.randn(1, 5), torch.randn(1, 5)
    nv = torch.cat([v[:, 1:], torch.zeros(1, 1)], 1)
    term = t([[0, 0, 0, 0, 1]], torch.bool)
    adv, ret = gae(r, v, nv, term, torch.zeros_like(term), torch.ones_like(term), 0.9, 1.0)
    mc = [sum(0.9 ** (k - i) * float(r[0, k]) for k in range(i, 5)) for i in range(5)]
    close(ret[0], mc)
    close(adv, ret - v)


# -- outcome estimators -------------------------------------------------------------------------
def test_grpo_normalises_within_each_of_two_groups():
    scores = t([1.0, 0.0, 1.0, 0.0, 2.0])
    groups = t([7, 7, 7, 3, 3], torch.int64)
    adv, ret = grpo(scores, groups, eps=0.0)
    s7 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)   # Bessel: divide by n - 1
    s3 = math.sqrt((1 + 1) / 1)
    close(adv, [(1 / 3) / s7, (-2 / 3) / s7, (1 / 3) / s7, -1 / s3, 1 / s3])
    close(ret, scores)
    raw, _ = grpo(scores, groups, norm_std=False)
    close(raw, [1 / 3, -2 / 3, 1 / 3, -1.0, 1.0])
    single, _ = grpo(t([5.0]), t([0], torch.int64))
    close(single, [0.0])


def test_rloo_uses_the_mean_of_the_others():
    scores = t([1.0, 0.0, 1.0, 0.0, 2.0, 4.0])
    groups = t([0, 0, 0, 1, 1, 2], torch.int64)
    adv, ret = rloo(scores, groups)
    close(adv, [1 - 0.5, 0 - 1.0, 1 - 0.5, 0 - 2.0, 2 - 0.0, 0.0])  # a lone episode gets 0
    close(ret, scores)


def test_remax_subtracts_the_greedy_baseline():
    adv, ret = remax(t([1.0, 0.0, 1.0]), t([1.0, 1.0, 0.0]))
    close(adv, [0.0, -1.0, 1.0])
    close(ret, [1.0, 0.0, 1.0])


def test_reinforce_pp_folds_kl_into_the_reward_and_whitens_over_the_batch():
    g, c = 0.5, 0.5
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]], torch.bool)
    kl = t([[0.2, 0.2, 0.2], [0.4, 0.0, 5.0]])
    adv, ret = reinforce_pp(rewards, mask, g, kl=kl, kl_coef=c, eps=0.0)
    # r' = r - 0.5 kl: row 0 [-0.1, -0.1, 0.9], row 1 [-0.2, 1.0, (pad)]
    g_row0 = [-0.1 + g * (-0.1 + g * 0.9), -0.1 + g * 0.9, 0.9]
    g_row1 = [-0.2 + g * 1.0, 1.0, 0.0]
    close(ret, [g_row0, g_row1])
    real = g_row0 + g_row1[:2]
    mu, sd = statistics.mean(real), statistics.stdev(real)
    close(adv, [[(x - mu) / sd for x in g_row0], [(x - mu) / sd for x in g_row1[:2]] + [0.0]])
    _, ret2 = reinforce_pp(rewards, mask, g)
    close(ret2[0], [0.25, 0.5, 1.0])
    assert float(masked_whiten(ret2, mask).sum()) == pytest.approx(0.0, abs=1e-5)


def test_dynamic_sampling_drops_groups_with_equal_outcomes():
    scores = t([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    groups = t([4, 4, 4, 9, 9, 2, 2, 5], torch.int64)   # all success, all failure, mixed, lone
    keep, dropped = dynamic_sampling_mask(scores, groups)
    assert keep.tolist() == [False] * 5 + [True, True, False]
    assert dropped == 3
    assert set(ESTIMATORS) == {"gae", "grpo", "rloo", "remax", "reinforce_pp"}


# -- KL -----------------------------------------------------------------------------------------
def test_kl_estimators_by_hand_and_k3_non_negative():
    logp, ref = t([0.0, -1.0, 2.0]), torch.zeros(3)
    close(kl_k1(logp, ref), [0.0, -1.0, 2.0])
    close(kl_k2(logp, ref), [0.0, 0.5, 2.0])
    close(kl_k3(logp, ref), [0.0, math.e - 2.0, math.exp(-2.0) + 1.0])
    close(kl_penalty("k3", logp, ref), kl_k3(logp, ref))
    close(kl_penalty("none", logp, ref), [0.0, 0.0, 0.0])
    torch.manual_seed(0)
    a, b = torch.randn(1000) * 30, torch.randn(1000) * 30
    k3 = kl_k3(a, b)
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    with pytest.raises(ValueError, match="unknown kl kind"):
        kl_penalty("k4", logp, ref)


def test_k3_is_an_unbiased_kl_estimate():
    """Samples from N(0, 1), reference N(0.5, 1): KL = 0.125."""
    torch.manual_seed(0)
    x = torch.randn(200_000)
    logp = -0.5 * x ** 2
    ref = -0.5 * (x - 0.5) ** 2
    assert float(kl_k3(logp, ref).mean()) == pytest.approx(0.125, abs=5e-3)
    assert float(kl_k1(logp, ref).mean()) == pytest.approx(0.125, abs=5e-3)


def test_episode_mean_weights_give_every_episode_the_same_total():
    import torch

    from agents.ppo.on_policy import ChunkBatch, episode_mean_weights

    lengths = [1, 3, 4]
    row = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2])
    col = torch.tensor([0, 0, 1, 2, 0, 1, 2, 3])
    cb = ChunkBatch.__new__(ChunkBatch)
    cb.row, cb.col, cb.lengths = row, col, lengths
    w = episode_mean_weights(cb)
    per_episode = torch.zeros(3).index_add_(0, row, w)
    assert torch.allclose(per_episode, torch.full((3,), 8 / 3))  # equal totals
    assert torch.isclose(w.mean(), torch.tensor(1.0))  # a chunk mean of w is 1
    assert w[0] == 4 * w[-1]  # the one-chunk episode's chunk counts as much as 4 of the long one's
