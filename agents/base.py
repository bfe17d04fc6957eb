"""The contracts between the learner and what it trains: Policy, Agent, and their pairing.

Batches are dicts of torch tensors with the keys of :mod:`data.core.schema`:

    "observation.state"           float32 [B, S]
    "observation.images.<cam>"    uint8   [B, H, W, 3]
    "task"                        list[str] of length B (only where the env has tasks)

A training batch (from the replay buffer) adds ``action`` [B, A] (or [B, H, A] for chunked
policies), ``reward`` [B], ``terminated`` [B] bool, ``truncated`` [B] bool,
``intervened`` [B] bool, ``policy_version`` [B] int64, and ``next.<obs key>`` for each
observation key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, runtime_checkable

import torch

Batch = dict[str, Any]


class NotSupported(NotImplementedError):
    """A policy does not provide a capability an algorithm asked for."""


@dataclass
class ActionChunk:
    """Policy output: ``actions`` [B, H, A] float32 in [-1, 1]; ``log_prob`` [B] or None."""

    actions: torch.Tensor
    log_prob: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    #: capabilities this policy provides, e.g. {"reparam_sample", "log_prob", "bc_loss"}
    capabilities: frozenset[str]
    chunk_size: int

    def act(self, obs: Batch, *, deterministic: bool = False) -> ActionChunk: ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class Agent(Protocol):
    policy: Policy

    def update(self, batches: Iterator[Batch]) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def check_pair(algo_name: str, requires: frozenset[str], policy_name: str,
               provides: frozenset[str]) -> None:
    """Fail with a message naming the pair and what is missing, at config time."""
    missing = sorted(requires - provides)
    if missing:
        raise ValueError(
            f"algorithm {algo_name!r} cannot train policy {policy_name!r}: the policy does not "
            f"provide {', '.join(missing)} (it provides {', '.join(sorted(provides)) or 'nothing'})"
        )
