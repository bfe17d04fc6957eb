"""The tanh squash of a Gaussian's sample, shared by the tanh-Gaussian policies and actors
(:class:`agents.policies.mlp.MLPPolicy`, SAC's noise and residual actors)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_LOG2 = math.log(2.0)


def tanh_log_det(u: torch.Tensor) -> torch.Tensor:
    """log(1 - tanh(u)^2), elementwise and numerically stable."""
    return 2.0 * (_LOG2 - u - F.softplus(-2.0 * u))
