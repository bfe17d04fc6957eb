"""Build and start an input device by name: :func:`make_source`."""

from __future__ import annotations

from envs.intervention.base import InterventionSource
from envs.intervention.expert import ExpertIntervention
from envs.intervention.gamepad import GamepadIntervention
from envs.intervention.keyboard import KeyboardIntervention
from envs.intervention.spacemouse import SpaceMouseIntervention


def make_source(kind: str, **kwargs) -> InterventionSource:
    """``keyboard``, ``gamepad``, ``spacemouse`` or ``expert`` (a scripted person; bind it to
    the env with its ``bind``), started; raises DeviceUnavailable with a clear message when
    the device is missing."""
    kinds = {"keyboard": KeyboardIntervention, "gamepad": GamepadIntervention,
             "spacemouse": SpaceMouseIntervention, "expert": ExpertIntervention}
    if kind not in kinds:
        raise ValueError(f"intervention device must be one of {', '.join(kinds)}, got {kind!r}")
    src = kinds[kind](**kwargs)
    src.start()
    return src
