"""SAC's phase dispatch, one place for its two callers: :class:`agents.sac.agent.SACModel`
(one prepared module: DDP or one process) and :class:`agents.parallel.sac_engines.SACEngines` (two
sharded engines). They differ only in how they sample the actor and score its actions."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from agents.base import Batch


def run_phase(what: str, batch: Batch, actions: torch.Tensor | None, prefix: str, *,
              sample: Callable, critic: Callable, temperature: nn.Module,
              score: Callable[[Batch, torch.Tensor], torch.Tensor], unknown: str):
    """One SAC phase: ``"critic"`` (Q of ``actions`` at ``prefix``), ``"next"`` (a', log pi,
    alpha at ``prefix``) or ``"actor"`` (a, log pi, ``score(batch, a)``, log_alpha);
    ``sample(batch[, prefix])`` -> (actions, log_prob). Any other ``what`` raises
    ``ValueError(unknown.format(what))``."""
    if what == "critic":
        return critic(batch, actions, prefix)
    if what == "next":
        a, logp = sample(batch, prefix)
        return a, logp, temperature()
    if what == "actor":
        a, logp = sample(batch)
        # log_alpha as a view, not the leaf: DDP finds used parameters through the outputs' graph
        return a, logp, score(batch, a), temperature.log_alpha.view(())
    raise ValueError(unknown.format(what))
