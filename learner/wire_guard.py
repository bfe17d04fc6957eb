"""Checks the learner runs on untrusted messages before anything else touches them (the
socket thread on its ROUTER, the inference thread on the act socket), and a rate-limited
logger for what they reject.

The codec (:func:`data.core.codec.decode`) has already checked types, header bounds and
that every buffer matches its claimed shape. What is left for a ``transitions`` message is
its layout as a batch: every array at least 1-d with one row per record, a record count in
``1..MAX_BATCH`` that matches ``tasks`` and ``last_seq``, and integer step arrays within
:data:`data.core.schema.STEP_BOUNDS` - so that no numpy or arithmetic error can arise later
from a crafted batch (a 0-d array, sequence numbers near the int64 limit, ...). An ``act``
request's observation must be a batch of exactly the env's arrays (:func:`check_obs`).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from data.core.codec import Message
from data.core.schema import MAX_BATCH, OBS_STATE, RTC_ARRAYS, RTC_DELAY, RTC_PENDING, RTC_PREFIX, STEP_BOUNDS, TASK
from data.core.spec import EnvSpec

_DTYPES = {"float32": np.dtype("float32"), "uint8": np.dtype("uint8")}


def check_transitions_message(msg: Message) -> str | None:
    """The first layout problem of a ``transitions`` message, or None."""
    tasks = msg["tasks"]
    n = len(tasks)
    if not 1 <= n <= MAX_BATCH:
        return f"a batch holds 1..{MAX_BATCH} records, this one has {n} tasks"
    for name, a in msg.arrays.items():
        if a.ndim == 0 or a.shape[0] != n:
            return f"array {name!r} has shape {tuple(a.shape)}; every array needs {n} rows (one per task)"
    if msg["last_seq"] != msg["first_seq"] + n - 1:
        return (f"last_seq {msg['last_seq']} does not match first_seq {msg['first_seq']} + "
                f"{n} records")
    for name, (lo, hi) in STEP_BOUNDS.items():
        a = msg.arrays.get(name)
        if a is None or a.dtype.kind not in "iu" or a.size == 0:
            continue  # a missing or mistyped array is named by the batch's own validation
        if a.size <= 256:  # small (the usual batch): Python's min/max of a list beat two reductions
            vals = a.ravel().tolist()
            amin, amax = min(vals), max(vals)
        else:
            amin, amax = int(a.min()), int(a.max())
        if amin < lo or amax > hi:
            return f"{name}: values must be in [{lo}, {hi}], got {amin}..{amax}"
    return None


def check_obs_layout(arrays: dict[str, np.ndarray]) -> str | None:
    """Every observation array of an ``act`` request is a batch (at least 1-d)."""
    for name, a in arrays.items():
        if a.ndim == 0:
            return f"array {name!r} is 0-dimensional; an act request is a batch [B, ...]"
    return None


#: id(spec) -> (spec, {array name: (dtype, per-row shape)}, the names): an act request is
#: checked against the same spec each time, so its expected layout is built once
_EXPECTED: dict[int, tuple[EnvSpec, dict[str, tuple[np.dtype, tuple[int, ...]]], frozenset[str]]] = {}


def _expected(spec: EnvSpec):
    hit = _EXPECTED.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit
    expected = {OBS_STATE: (_DTYPES["float32"], (spec.state_dim,))}
    for cam, shape in spec.cameras.items():
        expected["observation.images." + cam] = (_DTYPES["uint8"], tuple(shape))
    if len(_EXPECTED) > 64:
        _EXPECTED.clear()
    hit = _EXPECTED[id(spec)] = (spec, expected, frozenset(expected))
    return hit


#: (id(spec), id(layout)) -> (spec, layout, batch size, names of the float arrays): act request
#: layouts (the codec's cached array metadata, :attr:`data.core.codec.Message.layout`) whose
#: structure passed :func:`check_obs_layout` and :func:`check_obs` against that spec. Names,
#: dtypes and shapes are the layout's, so only the values are checked again.
_ACT_LAYOUTS: dict[tuple[int, int], tuple[EnvSpec, object, int, tuple[str, ...]]] = {}


def check_act_obs(msg: Message, spec: EnvSpec) -> str | None:
    """:func:`check_obs_layout` then :func:`check_obs` of an ``act`` request, the same errors;
    a layout seen before (the same spec) has its values checked only: floats finite, one
    instruction string per row (non-empty where the env needs them)."""
    arrays, tasks, layout = msg.arrays, msg["tasks"], msg.layout
    if layout is not None:
        hit = _ACT_LAYOUTS.get((id(spec), id(layout)))
        if hit is not None and hit[0] is spec and hit[1] is layout:
            return _check_obs_values(arrays, tasks, spec, hit[2], hit[3])
    err = check_obs_layout(arrays) or check_obs(arrays, tasks, spec)
    if err is None and layout is not None:
        _, expected, _ = _expected(spec)
        if len(_ACT_LAYOUTS) >= 256:
            _ACT_LAYOUTS.clear()
        _ACT_LAYOUTS[(id(spec), id(layout))] = (
            spec, layout, arrays[OBS_STATE].shape[0],
            tuple(k for k, (dt, _) in expected.items() if dt.kind == "f"))
    return err


def _check_obs_values(arrays: dict[str, np.ndarray], tasks: list, spec: EnvSpec, b: int,
                      floats: tuple[str, ...]) -> str | None:
    """The value checks of :func:`check_obs` (its messages), for a layout that passed it."""
    for k in floats:
        a = arrays[k]
        if not (all(map(math.isfinite, a.ravel().tolist())) if a.size <= 64 else np.isfinite(a).all()):
            return f"{k}: contains NaN or Inf"
    if len(tasks) != b or not all([isinstance(t, str) for t in tasks]):
        return f"{TASK}: expected {b} instruction strings"
    if spec.has_task and not all(tasks):
        return "missing task instruction: this env needs one per observation"
    return None


def check_obs(arrays: dict[str, np.ndarray], tasks: list, spec: EnvSpec) -> str | None:
    """Validate an act request's observation batch (after :func:`check_obs_layout`); return an
    error message or None. Both act paths run it, through :class:`learner.act_intake.ActIntake`."""
    state = arrays.get(OBS_STATE)
    if state is None:
        return f"missing {OBS_STATE!r}"
    b = state.shape[0] if state.ndim else 0
    if b < 1 or b > 1024:
        return f"batch size {b} out of range 1..1024"
    _, expected, names = _expected(spec)
    if arrays.keys() != names:
        extra = sorted(set(arrays) - names)
        if extra:
            return f"unexpected arrays {extra}"
    for k, (dt, shape) in expected.items():
        a = arrays.get(k)
        if a is None:
            n_img = len(spec.cameras)
            return f"missing {k!r} (this env has {n_img} camera(s): {sorted(spec.cameras)})"
        if a.dtype != dt or a.shape != (b, *shape):
            return f"{k}: got {a.dtype.name}{tuple(a.shape)}, expected {dt.name}{(b, *shape)}"
        if dt.kind == "f" and not (all(map(math.isfinite, a.ravel().tolist())) if a.size <= 64
                                   else np.isfinite(a).all()):
            return f"{k}: contains NaN or Inf"
    if len(tasks) != b or not all(isinstance(t, str) for t in tasks):
        return f"{TASK}: expected {b} instruction strings"
    if spec.has_task and not all(tasks):
        return "missing task instruction: this env needs one per observation"
    return None


def split_rtc(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """An act request's arrays -> (observation arrays, RTC arrays)."""
    if not any(k.startswith("rtc.") for k in arrays):
        return arrays, {}
    return ({k: a for k, a in arrays.items() if not k.startswith("rtc.")},
            {k: a for k, a in arrays.items() if k.startswith("rtc.")})


def check_rtc(rtc: dict[str, np.ndarray], b: int, chunk: int, action_dim: int) -> str | None:
    """The RTC arrays of an act request of ``b`` rows (:data:`data.core.schema.RTC_ARRAYS`):
    all three, ``rtc.prefix`` float32 [b, chunk, action_dim] finite, ``rtc.pending`` int64 [b] in
    0..chunk, ``rtc.delay`` int64 [b] in 0..pending. ``chunk`` 0: this learner serves no RTC."""
    if chunk <= 0:
        return ("this learner does not serve real-time chunking (rtc.* arrays sent): start it with "
                "rtc.enabled=true and a PI0/PI0.5 policy, or set chunk.rtc=false on the actor")
    unknown = sorted(set(rtc) - set(RTC_ARRAYS))
    missing = [k for k in RTC_ARRAYS if k not in rtc]
    if unknown or missing:
        return f"RTC arrays: unexpected {unknown}, missing {missing} (send all of {list(RTC_ARRAYS)})"
    want = {RTC_PREFIX: ("float32", (b, chunk, action_dim)), RTC_DELAY: ("int64", (b,)),
            RTC_PENDING: ("int64", (b,))}
    for k, (dt, shape) in want.items():
        a = rtc[k]
        if a.dtype != np.dtype(dt) or a.shape != shape:
            return f"{k}: got {a.dtype.name}{tuple(a.shape)}, expected {dt}{shape} (chunk horizon x action dim)"
    if not np.isfinite(rtc[RTC_PREFIX]).all():
        return f"{RTC_PREFIX}: contains NaN or Inf"
    pending, delay = rtc[RTC_PENDING], rtc[RTC_DELAY]
    if pending.min() < 0 or pending.max() > chunk:
        return f"{RTC_PENDING}: values must be in [0, {chunk}], got {int(pending.min())}..{int(pending.max())}"
    if (delay < 0).any() or (delay > pending).any():
        i = int(np.flatnonzero((delay < 0) | (delay > pending))[0])
        return (f"{RTC_DELAY}: row {i} has delay {int(delay[i])}; it must be in [0, pending] = "
                f"[0, {int(pending[i])}] (at most the chunk, {chunk})")
    return None


class RateLimitedLog:
    """At most ``burst`` warnings per ``window_s`` through ``logger``; the rest are counted
    and summarised in one line when the next window opens. Callers count every event
    themselves; this only bounds the log."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0):
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._window_start = -float("inf")
        self._in_window = 0
        self.suppressed = 0  # in the current window
        self.suppressed_total = 0

    def warning(self, fmt: str, *args, exc_info=None) -> bool:
        """Log unless over the limit; returns whether it was logged."""
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            if self.suppressed:
                self.logger.warning("... %d more like these in the last %.0fs were not logged "
                                    "(all are counted)", self.suppressed, now - self._window_start)
            self._window_start, self._in_window, self.suppressed = now, 0, 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            self.suppressed_total += 1
            return False
        self._in_window += 1
        self.logger.warning(fmt, *args, exc_info=exc_info)
        return True
