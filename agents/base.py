"""The contracts between the learner and what it trains: Policy, its typed capabilities,
and the algorithm Builder.

Batches are dicts of torch tensors with the keys of :mod:`data.core.schema`:

    "observation.state"           float32 [B, S]
    "observation.images.<cam>"    uint8   [B, H, W, 3]
    "task"                        list[str] of length B (only where the env has tasks)

A training batch (from the replay buffer) adds ``action`` [B, A] (or [B, H, A] when the
algorithm samples whole chunks), ``reward`` [B] (or [B, H]), ``terminated`` [B] bool,
``truncated`` [B] bool, ``intervened`` [B] bool, ``policy_version`` [B] int64,
``extra.<name>`` for each policy extra, and ``next.<obs key>`` for each observation key.

Capabilities are Protocols: a policy class has a capability when it defines every member of
the protocol (:func:`capabilities_of`). An algorithm lists the ones it needs in ``requires``
and :func:`check_pair` fails at start-up naming the pair and what is missing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

Batch = dict[str, Any]
#: a policy's extras: name -> (dtype, per-chunk shape), see :meth:`Policy.extras_spec`
ExtrasSpec = dict[str, tuple[str, tuple[int, ...]]]


class NotSupported(NotImplementedError):
    """A policy does not provide a capability an algorithm asked for."""


@dataclass
class ActionChunk:
    """Policy output: ``actions`` [B, H, A] float32 in [-1, 1]; ``log_prob`` [B] or None;
    ``extras`` name -> [B, ...] tensors (PI0's noise, OFT's action tokens, a value, ...)."""

    actions: torch.Tensor
    log_prob: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def extras_with_log_prob(self) -> dict[str, torch.Tensor]:
        """``extras`` plus ``log_prob`` under that name when there is one."""
        out = dict(self.extras)
        if self.log_prob is not None:
            out["log_prob"] = self.log_prob
        return out


@runtime_checkable
class Policy(Protocol):
    chunk_size: int

    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """Actions for ``obs`` (:class:`ActionChunk`). ``generator`` (optional: a policy may
        leave the keyword out): every random draw of this call comes from it (a
        ``torch.Generator`` on the policy's device); None draws from torch's global RNG as
        before. The learner's inference thread passes its own, so that serving acts leaves
        the global RNG that training draws from untouched (:mod:`learner.inference`)."""
        ...

    def extras_spec(self) -> ExtrasSpec:
        """The extras every :meth:`act` returns (``log_prob`` included when it returns one),
        name -> (dtype, shape of one chunk's value). They travel with the act reply into the
        records, the replay columns and the dataset as ``extra.<name>``."""
        ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


# -- typed capabilities -----------------------------------------------------------------------
@runtime_checkable
class BCPolicy(Protocol):
    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """Behaviour-cloning loss (scalar) of ``batch["action"]`` under the policy."""
        ...


@runtime_checkable
class LogProbPolicy(Protocol):
    def log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """Log-likelihood [B] of ``actions`` [B, H, A] (or [B, A] when H = 1)."""
        ...


@runtime_checkable
class TokenLogProbPolicy(Protocol):
    def token_log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """The factors of :meth:`LogProbPolicy.log_prob` [B, T] (they sum to it): per action
        token, or per denoising step and action of a flow chain; token-level PPO ratios."""
        ...


@runtime_checkable
class ReparamSampler(Protocol):
    def sample(self, obs: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample: (actions [B, H, A], log_prob [B]), differentiable in the
        policy's parameters. ``prefix="next."`` reads the next observation of a batch."""
        ...


@runtime_checkable
class ValuePolicy(Protocol):
    def value(self, obs: Batch) -> torch.Tensor:
        """State value [B]."""
        ...


@runtime_checkable
class FeaturePolicy(Protocol):
    @property
    def feature_dim(self) -> int: ...

    def features(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        """Observation features [B, feature_dim] a critic or value head can read."""
        ...


@runtime_checkable
class ReferencePolicy(Protocol):
    def reference(self) -> contextlib.AbstractContextManager:
        """Inside ``with policy.reference():`` the policy computes as its reference (for a
        LoRA model: the same model with its adapters and trained heads at their starting values,
        B = 0 or the SFT start it was built from; no second copy)."""
        ...


@runtime_checkable
class NoiseConditionedPolicy(Protocol):
    """A flow/diffusion policy whose denoising starts from a given noise (PI0, PI0.5):
    ``act(obs, noise=...)`` replays it, ``model_inputs(obs)`` are the tensors its backbone
    reads and ``forward_model(inputs, noise)`` integrates the flow from ``noise`` [B, H, D],
    ``noise_shape`` = (H, D) of one chunk's noise."""

    @property
    def noise_shape(self) -> tuple[int, int]: ...

    def model_inputs(self, obs: Batch) -> tuple: ...

    def forward_model(self, inputs: tuple, noise: torch.Tensor | None = None) -> torch.Tensor: ...


CAPABILITIES: tuple[type, ...] = (BCPolicy, LogProbPolicy, ReparamSampler, ValuePolicy,
                                  FeaturePolicy, ReferencePolicy, NoiseConditionedPolicy)


def _members(proto: type) -> frozenset[str]:
    return frozenset(getattr(proto, "__protocol_attrs__", ()))


def has_capability(policy_or_cls: Any, proto: type) -> bool:
    """True when the class defines every member of ``proto`` (checked on the class, so it
    works before a large model is built)."""
    cls = policy_or_cls if isinstance(policy_or_cls, type) else type(policy_or_cls)
    return all(getattr(cls, m, None) is not None for m in _members(proto))


def capabilities_of(policy_or_cls: Any) -> frozenset[type]:
    return frozenset(p for p in CAPABILITIES if has_capability(policy_or_cls, p))


def check_pair(algo_name: str, requires: Iterable[type], policy_name: str,
               policy_or_cls: Any) -> None:
    """Fail with a message naming the pair and what is missing, at start-up."""
    have = capabilities_of(policy_or_cls)
    missing = sorted(p.__name__ for p in requires if p not in have)
    if missing:
        raise ValueError(
            f"algorithm {algo_name!r} cannot train policy {policy_name!r}: the policy does not "
            f"provide {', '.join(missing)} (it provides "
            f"{', '.join(sorted(p.__name__ for p in have)) or 'nothing'})"
        )


# algorithms: their contracts are in agents/core.py; DDP and DeepSpeed in agents/parallel/__init__.py


def extras_ranges(policy: Any) -> dict[str, tuple[int, int]]:
    """The inclusive value ranges of a policy's integer extras (``extras_ranges()``, optional;
    ingest refuses records outside them)."""
    fn = getattr(policy, "extras_ranges", None)
    return dict(fn()) if callable(fn) else {}
