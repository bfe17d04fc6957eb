"""Human intervention: input devices that take over the action while held, and labels.

An :class:`InterventionSource` is polled once per env step and answers with an
:class:`InterventionState`: whether the human holds control, the human's action, and
one-shot events (``success``, ``failure``, ``reset``, ``quit``) since the last poll.

Device actions are a generic end-effector command ``[dx, dy, dz, droll, dpitch, dyaw,
gripper]`` in [-1, 1] (gripper -1 open, +1 closed); :class:`InterventionWrapper` maps it
onto the env's action space (7-D: as is; 4-D: ``[dx, dy, dz, gripper]``, gym-hil; 3-D:
``[dx, dy, dz]``; otherwise give ``action_map``). A :class:`ScriptedIntervention` may
produce env-space actions directly.

Sources:

* :class:`KeyboardIntervention`: a terminal in raw (cbreak) mode, no display and no
  ``pynput`` needed. ``i`` toggles takeover; while taking over, ``w/s`` x, ``a/d`` y,
  ``r/f`` z, ``j/l`` yaw, ``u/o`` roll, ``k/m`` pitch (or the arrow keys for x/y), held keys
  count while the terminal's auto-repeat keeps them coming; ``space`` toggles the gripper.
  Hotkeys: ``y`` success, ``n`` failure, ``x`` reset, ``q`` quit.
* :class:`GamepadIntervention`: pygame's joystick (SDL, works headless). Hold the right
  bumper to take over; left stick x/y, right stick z (vertical) and yaw; ``A`` closes,
  ``B`` opens the gripper; ``Y`` success, ``X`` failure, ``Back`` reset.
* :class:`SpaceMouseIntervention`: a 3Dconnexion SpaceMouse through ``hidapi`` (``hid``).
  Moving the cap beyond the dead zone takes over; left button toggles the gripper; the
  right button labels success.
* :class:`ScriptedIntervention`: a schedule or a function of (step, obs): tests, simulated
  demos.
* :class:`ExpertIntervention`: a scripted person driving with the env's own demonstrator
  (``env.unwrapped.expert_action()``) when the policy drifts (:mod:`envs.intervention.expert`).

Missing optional packages or devices raise :class:`DeviceUnavailable` with a message
saying what to install or plug in.

:class:`InterventionWrapper` sets ``info["intervened"]`` and ``info["human_action"]`` (the
action actually applied) on every step the human holds control, and ``info["policy_action"]``
(what the policy wanted). A ``success`` label ends the episode with reward 1 and
``info["is_success"] = True``; ``failure`` ends it with ``is_success`` False; ``reset`` ends
it as truncated (``info["human_reset"]``); ``quit`` sets ``info["quit"]``.
"""

from envs.intervention.base import (
    EVENTS, GENERIC_DIM, DeviceUnavailable, InterventionSource, InterventionState,
)
from envs.intervention.expert import ExpertIntervention
from envs.intervention.factory import make_source
from envs.intervention.gamepad import GamepadIntervention
from envs.intervention.keyboard import KeyboardIntervention
from envs.intervention.scripted import ScriptedIntervention
from envs.intervention.spacemouse import SPACEMOUSE_VENDORS, SpaceMouseIntervention
from envs.intervention.wrapper import InterventionWrapper, default_action_map

__all__ = [
    "EVENTS", "GENERIC_DIM", "DeviceUnavailable", "InterventionSource", "InterventionState",
    "ScriptedIntervention", "ExpertIntervention", "KeyboardIntervention", "GamepadIntervention", "SpaceMouseIntervention",
    "SPACEMOUSE_VENDORS", "make_source", "InterventionWrapper", "default_action_map",
]
