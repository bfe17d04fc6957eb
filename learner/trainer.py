"""The training step driver: when to update, from what, and counting.

``step()`` runs one ``agent.update`` when the buffer has enough data and the update/env-step
ratio allows it, and returns its metrics (or None). The update itself is the agent's pure
function of sampled batches; nothing here touches sockets or files.
"""

from __future__ import annotations

import itertools

from omegaconf import DictConfig


class Trainer:
    def __init__(self, agent, buffer, ingest, cfg: DictConfig):
        self.agent = agent
        self.buffer = buffer
        self.ingest = ingest
        self.batch_size = int(agent.cfg.batch_size)
        self.learning_starts = int(cfg.learning_starts)
        self.max_update_ratio = float(cfg.max_update_ratio)
        self.updates = 0
        self._batches = (self.buffer.sample(self.batch_size) for _ in itertools.count())

    def ready(self) -> bool:
        have = len(self.buffer)
        need = self.batch_size if self.updates else max(self.batch_size, self.learning_starts)
        if have < need:
            return False
        if self.max_update_ratio > 0:
            return self.updates < self.max_update_ratio * self.ingest.steps
        return True

    def step(self) -> dict[str, float] | None:
        if not self.ready():
            return None
        metrics = self.agent.update(self._batches)
        self.updates += 1
        return metrics

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
