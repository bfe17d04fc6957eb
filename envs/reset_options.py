"""The ``reset(options=...)`` every Tandem env takes: a learner's job (:class:`data.core.jobs.Job`).

An actor running a job calls ``env.reset(seed=job.seed, options={"task_id": t,
"init_state": i})``. Each env documents what ``t`` and ``i`` select; the rules shared by all:
both keys are optional, both are non-negative ints, any other key is a ``ValueError`` (a
misspelt option never silently does nothing), and reset's ``info`` reports ``task_id`` and
``init_state``.

Single-task envs (:mod:`envs.pendulum`, :mod:`envs.reacher`, :mod:`envs.gym_hil`) accept
``task_id`` 0 only. Their ``init_state`` names a deterministic initial state: the reset's
randomness (MuJoCo's reset noise, the target or object placement) is drawn from an RNG
seeded by :func:`init_state_seed` instead of the env's own, so the same ``init_state``
gives the same first observation whatever ``seed`` says, and the env's own RNG stream is
left as it was. Every non-negative int is a valid initial state.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

#: the keys ``reset(options=...)`` accepts
RESET_OPTIONS = ("task_id", "init_state")
#: mixed into :func:`init_state_seed` so init state ``i`` and ``reset(seed=i)`` differ
_INIT_STATE_SALT = 0x7A4D3E11


def check_reset_options(options: Mapping[str, Any] | None, env_name: str) -> dict[str, int | None]:
    """``{"task_id": int | None, "init_state": int | None}`` from ``options`` (may be None)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(RESET_OPTIONS))
    if unknown:
        raise ValueError(f"{env_name}: unknown reset options {unknown}; it takes {list(RESET_OPTIONS)}")
    out: dict[str, int | None] = {}
    for key in RESET_OPTIONS:
        v = options.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ValueError(f"{env_name}: reset option {key!r} must be an int >= 0, got {v!r}")
        out[key] = None if v is None else int(v)
    return out


def single_task_init_state(options: Mapping[str, Any] | None, env_name: str) -> int | None:
    """Check a single-task env's options (``task_id`` must be 0) and return ``init_state``."""
    opts = check_reset_options(options, env_name)
    if opts["task_id"] not in (None, 0):
        raise ValueError(f"{env_name} has one task: task_id must be 0, got {opts['task_id']}")
    return opts["init_state"]


def init_state_seed(init_state: int) -> int:
    """The 31-bit seed of initial state ``init_state`` (the same on every machine)."""
    seq = np.random.SeedSequence([_INIT_STATE_SALT, int(init_state)])
    return int(seq.generate_state(1, np.uint32)[0] >> 1)
