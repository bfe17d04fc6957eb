"""The contracts between an algorithm and the learner app, and nothing else (acme's shape).

An algorithm is a :class:`Builder` (one per ``algo=`` name, in ``agents/<algo>/builder.py``).
The learner app calls, in order:

1. :meth:`Builder.check_policy_class` at start-up, before a model is built (beyond the
   capability check of :func:`agents.base.check_pair`);
2. :meth:`Builder.wrap_policy` on every policy it builds, the trained copy and the serving copy
   alike (noise-space SAC: PI0 + a noise actor; residual SAC: OFT + a residual);
3. :meth:`Builder.make_networks`, :meth:`Builder.make_data` (an :class:`AlgoData`: ingest feeds
   its ``sink``), :meth:`Builder.make_learner` (an :class:`AlgoLearner`, which owns the update
   cadence);
4. :meth:`Builder.jobs`: a :class:`JobSource` that hands actors their next episode, or None
   (actors run as they like).

Policies' contracts (capabilities) are in :mod:`agents.base`.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Protocol

import torch

from data.core.jobs import Job
from data.core.spec import EnvSpec


class Sink(Protocol):
    """Where ingest puts accepted records (replay ring, rollout queue, ...)."""

    def add(self, batch) -> int:
        """Store a validated :class:`data.core.transitions.TransitionBatch` of one actor."""
        ...

    def abandon(self, actor_id: str, episode: int) -> None:
        """An unfinished episode of the actor was dropped by ingest."""
        ...


class AlgoData(Protocol):
    """An algorithm's data, as the learner app uses it: ``sink`` (ingest's :class:`Sink`),
    ``store`` (the LeRobot episode store, or None), ``status()`` (``status.json`` -> ``replay``)
    and ``close()``. What the learner samples from is the algorithm's own business."""

    @property
    def sink(self) -> Sink: ...

    @property
    def store(self) -> Any: ...

    def status(self) -> dict: ...

    def close(self, timeout: float = 30.0) -> None: ...


def direct_route(data: Any) -> Any:
    """:attr:`AlgoLearner.route` of one process: the data as it is."""
    return data


class AlgoLearner(Protocol):
    """An algorithm's training side, built by its :class:`Builder`. It owns the update
    cadence: :meth:`step` runs one update when its data allows and returns metrics, else
    None. ``policy`` is the trained policy, whose ``trainable_state_dict`` is published;
    ``agent`` the update; ``updates`` counts updates. Every update's data (a batch, or a stream
    of batches) goes to ``agent.update`` through ``route`` (:func:`direct_route`; the
    multi-rank learner's rank 0 sets one that announces the update to the other ranks and
    scatters the data: :class:`learner.distributed.RootRoute`)."""

    policy: Any
    agent: Any
    updates: int
    route: Callable[[Any], Any]

    def step(self) -> dict[str, float] | None: ...

    def should_publish(self) -> bool:
        """True after an update that must go out as a new weights version."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class JobSource(Protocol):
    """Hands an actor the job of its next episode (``None``: run as it likes). Called from
    the service's socket thread: thread-safe and quick."""

    def next_job(self, actor_id: str, episode: int) -> Job | None: ...


class Builder(abc.ABC):
    """One per algorithm; :attr:`cfg` is its config dataclass, whose ``requires`` lists the
    policy capabilities it needs (module docstring: the order the learner app calls)."""

    name: str = ""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @property
    def requires(self) -> tuple[type, ...]:
        """The policy capabilities (:data:`agents.base.CAPABILITIES`) this algorithm needs."""
        return tuple(self.cfg.requires)

    def check_policy_class(self, policy_name: str, cls: type) -> None:
        """Start-up checks beyond the capabilities (raise ValueError naming the problem)."""

    def wrap_policy(self, policy: Any) -> Any:
        """The policy this algorithm trains and serves, made from the configured one."""
        return policy

    @abc.abstractmethod
    def make_networks(self, spec: EnvSpec, policy: Any, device: torch.device) -> Any: ...

    @abc.abstractmethod
    def make_data(self, spec: EnvSpec, replay_cfg: Any, *, run_dir, seed: int, device: str,
                  train: bool) -> AlgoData: ...

    @abc.abstractmethod
    def make_learner(self, networks: Any, data: AlgoData, accelerator: Any, *,
                     env_steps: Callable[[], int]) -> AlgoLearner: ...

    def jobs(self) -> JobSource | None:
        """The job source of this run, or None (actors run as they like)."""
        return None
