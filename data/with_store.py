"""What the learner's algorithm data (:class:`data.sampler.Replay`, :class:`data.rollouts.Rollouts`)
share: an optional episode store beside their sink, whose status joins theirs and which closes
first (it drains what ingest handed it before the sink goes)."""

from __future__ import annotations

from typing import Any


class WithStore:
    """Mixin for a dataclass with a ``store`` field (an episode store, or None)."""

    store: Any

    def _status_with_store(self, st: dict) -> dict:
        if self.store is not None:
            st.update(self.store.status())
        return st

    def _close_store(self, timeout: float) -> None:
        if self.store is not None:
            self.store.close(timeout)
