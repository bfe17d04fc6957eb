"""The clipped-surrogate update's configuration: :class:`PolicyUpdateConfig` (what PPO and GRPO
share: clipping, penalties, optimisation, staleness), :class:`PPOConfig` (PPO's: discounting,
the value function, rounds of episodes). GRPO's config (:class:`agents.grpo.agent.GRPOConfig`)
extends :class:`PolicyUpdateConfig` with its groups and derives the :class:`PPOConfig` its
update runs."""

from __future__ import annotations

from dataclasses import dataclass

from agents.base import LogProbPolicy, ReferencePolicy, TokenLogProbPolicy
from agents.common.advantages import ESTIMATORS
from agents.common.kl import KL_KINDS

#: where the importance ratio is taken (PolicyUpdateConfig.ratio_level)
RATIO_LEVELS = ("auto", "token", "chunk")


@dataclass
class PolicyUpdateConfig:
    """The keys of the clipped-surrogate update (:class:`agents.ppo.agent.PPOAgent`) that PPO and
    GRPO share, with PPO's defaults."""

    #: the ratio is clipped below at 1 - clip_low
    clip_low: float = 0.2
    #: the ratio is clipped above at 1 + clip_high (DAPO / SimpleVLA-RL "clip higher": 0.28)
    clip_high: float = 0.2
    #: dual-clip PPO (verl's clip_ratio_c): A < 0 losses capped at -A * dual_clip (None: off)
    dual_clip: float | None = None
    #: weight of the entropy bonus (subtracted from the loss)
    entropy_coef: float = 0.0
    #: KL penalty to the reference policy: estimator "k1", "k2", "k3" or "none", and weight (0:
    #: off; > 0 needs a ReferencePolicy or "ref_log_prob" in batches)
    kl_kind: str = "none"
    kl_coef: float = 0.0
    #: passes over each batch
    epochs: int = 4
    #: chunks per minibatch (one optimizer step each)
    minibatch_size: int = 64
    #: Adam learning rate of the policy
    lr: float = 3e-4
    #: clip the global gradient norm of each network to this value (None: no clipping)
    max_grad_norm: float | None = 0.5
    #: rollouts more than this many policy versions old are dropped (0: strictly on-policy)
    max_staleness: int = 1
    #: cap of the weights pi_prox / pi_behaviour of stale rollouts (None: ratio against behaviour)
    is_truncation: float | None = 2.0
    #: "token": a clipped ratio per factor of the chunk's likelihood (TokenLogProbPolicy and
    #: is_truncation); "chunk": one per chunk; "auto": token when the policy has them
    ratio_level: str = "auto"
    #: token-level ratios: the tokens of a chunk's actions that were never executed (the episode
    #: ended mid-chunk, or the actor runs only ``chunk.execute`` of each) leave the policy loss
    mask_unexecuted: bool = True
    #: advantage estimator, a key of :data:`agents.common.advantages.ESTIMATORS`
    estimator: str = "gae"
    #: "chunk_mean" or "episode_mean" (every episode alike; builders pass ``chunk_weight``)
    loss_agg: str = "chunk_mean"
    #: update rounds between published weight versions
    publish_every: int = 1

    def __post_init__(self) -> None:
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or null), got {self.dual_clip}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, "
                             f"{self.clip_high}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.loss_agg not in ("chunk_mean", "episode_mean"):
            raise ValueError(f"loss_agg must be chunk_mean or episode_mean, got {self.loss_agg!r}")
        if min(self.epochs, self.minibatch_size, self.publish_every) < 1:
            raise ValueError("epochs, minibatch_size and publish_every must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.is_truncation is not None and self.is_truncation <= 0:
            raise ValueError(f"is_truncation must be > 0 or None, got {self.is_truncation}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.ratio_level == "token" and self.is_truncation is None:
            raise ValueError("ratio_level=token needs is_truncation (the records carry the behaviour "
                             "log-prob per chunk, so token ratios are taken against the proximal policy)")

    @property
    def kl_active(self) -> bool:
        return self.kl_kind != "none" and self.kl_coef > 0

    @property
    def requires(self) -> tuple[type, ...]:
        """The policy capabilities this configuration needs (a value net is made by the
        builder when the policy has none, so ValuePolicy is not required)."""
        need = (LogProbPolicy, ReferencePolicy) if self.kl_active else (LogProbPolicy,)
        return need + ((TokenLogProbPolicy,) if self.ratio_level == "token" else ())


@dataclass
class PPOConfig(PolicyUpdateConfig):
    """Hyperparameters of :class:`agents.ppo.agent.PPOAgent` and its cadence (the PPO builder):
    :class:`PolicyUpdateConfig` plus discounting, the value function and the rounds."""

    #: discount factor (per policy step: per chunk for chunked policies) and GAE lambda
    gamma: float = 0.99
    lam: float = 0.95
    #: value updates are clipped to +-value_clip around the rollout's values (None: no clipping)
    value_clip: float | None = 0.2
    #: weight of the value loss in the total loss
    value_coef: float = 0.5
    #: no further pass over a batch once one's mean approx_kl exceeds it (None: off)
    target_kl: float | None = None
    #: finished episodes per update round (the builder waits for this many)
    batch_episodes: int = 8
    #: Adam lr of the value function (also of a ValuePolicy's own ``value_parameters()``)
    value_lr: float = 1e-3
    #: whiten the advantages of each batch (mean 0, std 1 over the real chunks)
    normalize_advantages: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if self.value_coef < 0:
            raise ValueError("value_coef must be >= 0")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {self.estimator!r}")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 or None, got {self.target_kl}")
        if self.batch_episodes < 1:
            raise ValueError(f"batch_episodes must be >= 1, got {self.batch_episodes}")
