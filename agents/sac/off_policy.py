"""The update cadence of replay-based algorithms (SAC, rejection sampling, ...).

:class:`OffPolicyLearner` decides *when* to update: once the sampler holds
``max(batch_size, learning_starts)`` transitions, and never more than
``max_update_ratio`` updates per stored env step (0: unlimited). Each update is the
algorithm's pure ``update(batches) -> metrics`` over batches drawn from the sampler
(``horizon`` > 1 draws windows of that many steps for chunked critics). Every
``publish_every`` updates the policy's trainable weights go out as a new version.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

from agents.core import direct_route


class OffPolicyLearner:
    def __init__(self, agent: Any, sampler: Any, *, batch_size: int, env_steps: Callable[[], int],
                 learning_starts: int = 0, max_update_ratio: float = 1.0, publish_every: int = 1,
                 horizon: int = 1):
        self.agent = agent
        self.route = direct_route
        self.policy = agent.policy
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.env_steps = env_steps
        self.learning_starts = int(learning_starts)
        self.max_update_ratio = float(max_update_ratio)
        self.publish_every = int(publish_every)
        self.horizon = int(horizon)
        self.updates = 0
        kw = {"horizon": self.horizon} if self.horizon > 1 else {}
        self._batches: Iterator = (sampler.sample(self.batch_size, **kw) for _ in itertools.count())

    def ready(self) -> bool:
        have = len(self.sampler)
        need = self.batch_size if self.updates else max(self.batch_size, self.learning_starts)
        if have < need:
            return False
        if self.max_update_ratio > 0:
            return self.updates < self.max_update_ratio * self.env_steps()
        return True

    def step(self) -> dict[str, float] | None:
        if not self.ready():
            return None
        metrics = self.agent.update(self.route(self._batches))
        self.updates += 1
        return metrics

    def should_publish(self) -> bool:
        return self.updates > 0 and self.updates % self.publish_every == 0

    def state_dict(self) -> dict:
        return {"agent": self.agent.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.agent.load_state_dict(state["agent"])
        self.updates = int(state["updates"])
