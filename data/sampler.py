"""What the trainer samples from: the online buffer, demos mixed in, filtered views.

Everything here has the buffer's sampling interface: ``sample(n) -> dict of tensors`` (see
:meth:`data.replay.ReplayBuffer.sample`) and ``len()`` (sampleable transitions).

- :class:`MixedSampler`: each batch draws ``round(n * demo_ratio)`` transitions from a demo
  buffer and the rest from the online buffer (RLPD's symmetric sampling: 0.5 by default).
  While one side is empty the other fills the batch. ``batch["is_demo"]`` marks the rows.
- :class:`SuccessView`: only transitions of successful episodes (an episode's outcome is its
  final record's ``success``) plus intervention segments (records a human drove), for
  rejection sampling / filtered behaviour cloning; ``exclude`` holds some out
  (:func:`groups_from`: evaluation jobs).
- :class:`PolicyVersionView`: only transitions whose action came from a policy at most
  ``max_lag`` versions behind the current one, for on-policy algorithms (PPO).

:func:`build_replay` makes the learner's buffer, episode store (refilled from disk) and
sampler from the ``buffer:`` config section; :func:`build_store` makes the store alone (the
on-policy algorithms' :mod:`data.rollouts` uses it too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from data.replay import ReplayBuffer
from data.core.spec import EnvSpec
from data.with_store import WithStore

log = logging.getLogger("tandem.data.sampler")


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in parts[0]:
        if isinstance(parts[0][k], torch.Tensor):
            out[k] = torch.cat([p[k] for p in parts])
        else:
            out[k] = [x for p in parts for x in p[k]]
    return out


class MixedSampler:
    """Online + demo transitions in a fixed ratio per batch (RLPD: 50/50)."""

    def __init__(self, online, demo, *, demo_ratio: float = 0.5):
        if not 0.0 <= demo_ratio <= 1.0:
            raise ValueError(f"demo_ratio must be in [0, 1], got {demo_ratio}")
        self.online = online
        self.demo = demo
        self.demo_ratio = float(demo_ratio)

    def __len__(self) -> int:
        return len(self.online) + len(self.demo)

    def split(self, n: int) -> tuple[int, int]:
        """(online, demo) rows of a batch of ``n``."""
        n_demo = int(round(n * self.demo_ratio))
        if len(self.online) == 0:
            n_demo = n
        elif len(self.demo) == 0:
            n_demo = 0
        return n - n_demo, n_demo

    def sample(self, n: int, **kw) -> dict[str, Any]:
        """``kw`` (e.g. ``horizon``) go to both sides' ``sample``."""
        n_on, n_demo = self.split(n)
        parts, flags = [], []
        if n_on:
            parts.append(self.online.sample(n_on, **kw))
            flags.append(torch.zeros(n_on, dtype=torch.bool))
        if n_demo:
            parts.append(self.demo.sample(n_demo, **kw))
            flags.append(torch.ones(n_demo, dtype=torch.bool))
        batch = _concat(parts) if len(parts) > 1 else parts[0]
        ref = next(v for v in batch.values() if isinstance(v, torch.Tensor))
        batch["is_demo"] = torch.cat(flags).to(ref.device)
        return batch


class SuccessView:
    """Transitions of successful episodes plus intervention segments. ``exclude`` (a
    :data:`data.replay.SlotFilter`) removes slots from the view, e.g.
    :func:`groups_from` for held-out evaluation episodes."""

    def __init__(self, buffer: ReplayBuffer, *, include_interventions: bool = True,
                 exclude: Callable[[ReplayBuffer], np.ndarray] | None = None):
        self.buffer = buffer
        self.include_interventions = include_interventions
        self.exclude = exclude

    def _where(self, b: ReplayBuffer) -> np.ndarray:
        m = b.episode_success
        m = (m | b.intervened) if self.include_interventions else m
        return m if self.exclude is None else m & ~self.exclude(b)

    def count_intervened(self) -> int:
        """Transitions of the view that a person drove."""
        return self.buffer.count(lambda b: self._where(b) & b.intervened)

    def __len__(self) -> int:
        return self.buffer.count(self._where)

    def sample(self, n: int, **kw) -> dict[str, Any]:
        return self.buffer.sample(n, where=self._where, **kw)


def groups_from(first_group: int) -> Callable[[ReplayBuffer], np.ndarray]:
    """A slot filter: the records of episodes whose job ``group_id`` >= ``first_group``."""
    return lambda b: b._cols["group_id"] >= first_group  # under the buffer's lock


class PolicyVersionView:
    """Transitions whose action came from policy version >= current - ``max_lag``."""

    def __init__(self, buffer: ReplayBuffer, current_version: Callable[[], int], *, max_lag: int = 0):
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        self.buffer = buffer
        self.current_version = current_version
        self.max_lag = int(max_lag)

    def _where(self, b: ReplayBuffer) -> np.ndarray:
        return b.policy_versions >= int(self.current_version()) - self.max_lag

    def __len__(self) -> int:
        return self.buffer.count(self._where)

    def sample(self, n: int, **kw) -> dict[str, Any]:
        return self.buffer.sample(n, where=self._where, **kw)


@dataclass
class Replay(WithStore):
    """The learner's replay pieces: ``buffer`` (ingest's sink: it adds records to it),
    ``store`` (or None), ``sampler`` (what the algorithm samples: the buffer, or demos
    mixed in)."""

    buffer: ReplayBuffer
    store: Any = None
    sampler: Any = None
    demo: ReplayBuffer | None = None

    @property
    def sink(self) -> ReplayBuffer:
        return self.buffer

    def status(self) -> dict:
        st: dict[str, Any] = {"transitions": len(self.buffer), "records": self.buffer.num_records}
        if self.demo is not None:
            st["demo_transitions"] = len(self.demo)
        return self._status_with_store(st)

    def close(self, timeout: float = 30.0) -> None:
        self._close_store(timeout)
        self.buffer.close()
        if self.demo is not None:
            self.demo.close()


def _getter(cfg) -> Callable:
    return cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))


def build_store(cfg, spec: EnvSpec, *, run_dir: str | Path, train: bool = True,
                refill_into: ReplayBuffer | None = None):
    """The LeRobot episode store of the ``buffer:`` config section, opened (recovering from a
    crash) and its writer thread started; None when not training or ``persist`` is off.
    ``refill_into``: a buffer to reload the newest committed episodes into first."""
    get = _getter(cfg)
    if not train or not get("persist", True):
        return None
    from data.store import EpisodeStore

    root = get("dataset_dir", None) or Path(run_dir) / "dataset"
    store = EpisodeStore(root, spec, fps=int(get("fps", 10)), video=bool(get("video", True)),
                         vcodec=get("vcodec", None), encoder=str(get("encoder", "pool")),
                         encode_workers=int(get("encode_workers", 2)),
                         commit_interval_s=float(get("commit_interval_s", 0.0)),
                         max_episodes_per_commit=int(get("max_episodes_per_commit", 32)))
    if refill_into is not None:
        store.load_into(refill_into)
    store.start()
    return store


def build_replay(cfg, spec: EnvSpec, *, run_dir: str | Path, seed: int = 0, device: str = "cpu",
                 train: bool = True) -> Replay:
    """Buffer, episode store and sampler from the ``buffer:`` config section. In training the
    store is opened (recovering from a crash), the buffer refilled from it, and its writer
    thread started; demos, if configured, are loaded and mixed in."""
    get = _getter(cfg)
    buffer = ReplayBuffer(int(get("capacity")), spec, seed=seed, device=device,
                          image_codec=str(get("image_codec", "raw")),
                          decode_threads=int(get("decode_threads", 2)))
    rep = Replay(buffer, sampler=buffer)
    if not train:
        return rep
    rep.store = build_store(cfg, spec, run_dir=run_dir, train=train,
                            refill_into=buffer if get("refill", True) else None)
    demos = get("demos", None)
    if demos:
        from data.demos import load_demos

        rep.demo = load_demos(demos, spec, capacity=get("demo_capacity", None), seed=seed + 1,
                              device=device, image_codec=str(get("image_codec", "raw")))
        rep.sampler = MixedSampler(buffer, rep.demo, demo_ratio=float(get("demo_ratio", 0.5)))
    return rep
