"""Group relative policy optimisation (GRPO) for robot episodes: critic-free PPO whose
advantage is an episode's outcome compared with the other episodes of its group.

A *group* is ``group_size`` episodes of the same job (task, initial state, seed family) run
by the current policy; each episode is scored once (success or return, ``score``) and its
advantage, (score - group mean) / group std (:func:`agents.common.advantages.grpo`; or RLOO /
ReMax, ``estimator``), is given to every chunk of the episode. Groups whose outcomes are
all equal carry no signal and are dropped (``dynamic_sampling``, DAPO). The update is
:func:`agents.ppo.agent.policy_loss` with the clip-higher bounds of DAPO / SimpleVLA-RL, an
optional KL penalty to the reference (the policy with its adapters and heads at their start),
and the same staleness correction as PPO; there is no value function.

The batch is PPO's (:mod:`agents.ppo.agent`) without ``returns``: flat per chunk, with the
episode's advantage precomputed per chunk (:func:`group_advantages` gives the per-episode
values and which episodes to keep).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from agents.common.advantages import dynamic_sampling_mask, grpo, remax, rloo
from agents.ppo.agent import PPOAgent
from agents.ppo.config import PolicyUpdateConfig, PPOConfig

#: what an episode is scored by
SCORES = ("success", "return")
#: outcome estimators GRPO may use
GROUP_ESTIMATORS = ("grpo", "rloo", "remax")


@dataclass
class GRPOConfig(PolicyUpdateConfig):
    """Hyperparameters of :class:`GRPOAgent` and its cadence (the GRPO builder): the update's
    keys are PPO's (:class:`agents.ppo.config.PolicyUpdateConfig`, with GRPO's defaults below),
    plus the groups; :meth:`ppo_config` is the PPO update it runs.

    Temperature: GRPO needs diverse outcomes within a group, so actors sample
    (``deterministic=False``) from the policy's own distribution; the behaviour log-prob in
    the records is of that same distribution, which the importance ratio relies on. Raise the
    policy's own noise (e.g. its std bounds) rather than rescaling actions on the actor.
    """

    #: episodes per group (same job, different seeds)
    group_size: int = 8
    #: groups per update round (the builder waits for this many complete groups)
    batch_groups: int = 4
    #: divide by the group's std ("grpo" only; False is Dr. GRPO)
    norm_std: bool = True
    #: an episode's score: "success" (1.0 when the episode ended in success, else 0.0) or
    #: "return" (undiscounted sum of rewards)
    score: str = "success"
    #: drop groups whose scores are all equal (DAPO dynamic sampling)
    dynamic_sampling: bool = True
    # -- GRPO's defaults of the update's keys
    #: outcome estimator: "grpo" (group mean/std), "rloo" (leave-one-out) or "remax"
    #: (minus the greedy rollout of the same job, which the builder adds to each group)
    estimator: str = "grpo"
    #: clip higher (DAPO / SimpleVLA-RL)
    clip_high: float = 0.28
    #: KL estimator of the penalty (its weight ``kl_coef`` is 0: off, as DAPO / SimpleVLA-RL)
    kl_kind: str = "k3"
    epochs: int = 1
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.group_size < 2 or self.batch_groups < 1:
            raise ValueError(f"group_size must be >= 2 and batch_groups >= 1, got "
                             f"{self.group_size}, {self.batch_groups}")
        if self.estimator not in GROUP_ESTIMATORS:
            raise ValueError(f"estimator must be one of {GROUP_ESTIMATORS}, got {self.estimator!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        super().__post_init__()

    def ppo_config(self) -> PPOConfig:
        """The PPO update this GRPO runs: its update keys, no value loss, advantages used as given."""
        shared = {f.name: getattr(self, f.name) for f in fields(PolicyUpdateConfig)}
        return PPOConfig(**shared, value_clip=None, value_coef=0.0, normalize_advantages=False,
                         batch_episodes=self.group_size * self.batch_groups)


def group_advantages(cfg: GRPOConfig, scores: torch.Tensor, group_ids: torch.Tensor,
                     baseline_scores: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-episode advantages [N] of ``scores`` [N] in groups ``group_ids`` [N], which
    episodes to keep [N] bool, and how many groups dynamic sampling dropped.

    ``baseline_scores`` [N] (the greedy rollout's score of each episode's job) is needed for
    ``estimator="remax"``. Dropped episodes get advantage 0.
    """
    if cfg.dynamic_sampling:
        keep, dropped = dynamic_sampling_mask(scores, group_ids)
    else:
        keep, dropped = torch.ones_like(group_ids, dtype=torch.bool), 0
    if cfg.estimator == "grpo":
        adv, _ = grpo(scores, group_ids, norm_std=cfg.norm_std)
    elif cfg.estimator == "rloo":
        adv, _ = rloo(scores, group_ids)
    else:
        if baseline_scores is None:
            raise ValueError("estimator 'remax' needs baseline_scores")
        adv, _ = remax(scores, baseline_scores)
    return adv * keep.to(adv.dtype), keep, dropped


class GRPOAgent(PPOAgent):
    """GRPO over a :class:`agents.base.LogProbPolicy`: :class:`agents.ppo.agent.PPOAgent`'s update
    without a critic, on advantages precomputed per chunk from the episode's group outcome.
    ``self.cfg`` is the derived :class:`PPOConfig` (:meth:`GRPOConfig.ppo_config`); ``self.grpo_cfg`` the given config."""

    name = "grpo"

    def __init__(self, cfg: GRPOConfig, policy, accelerator):
        self.grpo_cfg = cfg
        super().__init__(cfg.ppo_config(), policy, None, accelerator)
