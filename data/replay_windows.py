"""Action-chunk windows over the replay ring's ``next_idx`` links (SAC over action chunks,
Q-chunking style), vectorised: one numpy gather per step of the horizon, no per-sample loop.

A *window* of horizon H starts at a sampleable record t (it has a successor and is not
``is_last``) and follows ``next_idx`` through the same episode for up to H-1 more steps. It
stops early after a step that terminated or truncated the episode, or when the next record is
the episode's ``is_last`` record. Its *real steps* are t and the records it reached; their
count is k (1 <= k <= H), and the window's next observation is the successor of its last real
step.

**Availability.** A window is returned only when all its real steps and its next observation
are stored and have arrived: every record the walk reaches must either be the episode's
``is_last`` record (the episode ended) or itself have a successor. Equivalently: the record
H-1 steps after t has a successor, or the episode ended before it. A walk that reaches a
record whose successor has not arrived yet (an open episode's newest records, or an abandoned
episode's last one) marks the window unavailable; it becomes available once those records
arrive.

**No stale window.** A successor is always newer than its predecessor and the ring overwrites
the oldest slot first, so while t is stored every record of its chain is stored too; a link to
an overwritten record is never made and an overwritten slot drops its links (``next_idx = -1``).
The walk runs under the buffer's lock, so it never crosses into a reused slot.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class Windows(NamedTuple):
    slots: np.ndarray   # int64 [B, H]: slot of each step; past the end, the last real slot
    mask: np.ndarray    # bool  [B, H]: real steps
    final: np.ndarray   # int64 [B]: slot of the next observation after the last real step
    ok: np.ndarray      # bool  [B]: window available (see the module docstring)


def follow(idx: np.ndarray, horizon: int, *, next_idx: np.ndarray, valid: np.ndarray,
           is_last: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> Windows:
    """Walk ``horizon`` steps from the sampleable slots ``idx`` (the ring's per-slot arrays:
    ``valid`` = has a successor and is not ``is_last``). Rows with ``ok`` False hold their
    partial walk and must not be used."""
    idx = np.asarray(idx, np.int64)
    b = idx.shape[0]
    slots = np.empty((b, horizon), np.int64)
    mask = np.zeros((b, horizon), bool)
    slots[:, 0] = idx
    mask[:, 0] = True
    final = next_idx[idx].astype(np.int64)
    ok = np.ones(b, bool)
    alive = np.flatnonzero(~(terminated[idx] | truncated[idx]))  # rows whose window goes on
    for j in range(1, horizon):
        slots[:, j] = slots[:, j - 1]
        if alive.size == 0:
            continue
        nxt = final[alive]                   # successor of each live row's last real step
        last = is_last[nxt]
        real = valid[nxt]                    # a step with its own successor stored
        ok[alive[~(last | real)]] = False    # successor not arrived: unavailable
        rows, nxt = alive[real], nxt[real]
        slots[rows, j] = nxt
        mask[rows, j] = True
        final[rows] = next_idx[nxt]
        alive = rows[~(terminated[nxt] | truncated[nxt])]
    return Windows(slots, mask, final, ok)


def draw(rng: np.random.Generator, pool: np.ndarray, n: int, horizon: int,
         walk: Callable[[np.ndarray], Windows], *, tries: int = 4) -> Windows:
    """``n`` available windows whose starts are uniform (with replacement) over the available
    starts in ``pool``: rejection sampling (unavailable starts are rare: the newest H-1 records
    of each open episode), then an exact pass over the whole pool if rows are still missing.
    Raises ValueError when no start in ``pool`` is available."""
    idx = pool[rng.integers(0, len(pool), size=n)]
    first = walk(idx)
    if first.ok.all():  # the common case: one walk
        return first
    need = np.flatnonzero(~first.ok)
    for _ in range(tries):
        idx[need] = pool[rng.integers(0, len(pool), size=need.size)]
        need = need[~walk(idx[need]).ok]
        if need.size == 0:
            break
    if need.size:
        avail = pool[walk(pool).ok]
        if avail.size == 0:
            raise ValueError(f"replay buffer has no complete window of horizon {horizon}")
        idx[need] = avail[rng.integers(0, len(avail), size=need.size)]
    return walk(idx)
