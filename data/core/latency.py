"""A latency histogram of fixed log-spaced bins, for percentiles over a whole run in constant
memory: the learner's act latency per actor and over all actors (:mod:`learner.actor_stats`,
``status.json``, ``metrics.jsonl``) and each actor's act round trip (:mod:`actor.client`).

Bins: 50 per decade from :data:`LO_MS` to :data:`HI_MS` (each 4.7% wide), plus one below and one
above. A percentile is the geometric middle of the bin it falls in, so it is within 2.4% of the
exact sample percentile (inside the range); the largest value and the sum are kept exactly.
Histograms add (:meth:`LatencyHistogram.merge`), so a percentile over many actors or over
several periods is that of the pooled samples.
"""

from __future__ import annotations

import math

import numpy as np

LO_MS, HI_MS, PER_DECADE = 0.01, 1e6, 50
_N = int(round(math.log10(HI_MS / LO_MS) * PER_DECADE))
#: bin edges in ms: bin i (1.._N) holds [EDGES[i-1], EDGES[i]); 0 below LO_MS, _N+1 at or above HI_MS
EDGES = LO_MS * 10.0 ** (np.arange(_N + 1) / PER_DECADE)


class LatencyHistogram:
    __slots__ = ("counts", "max_ms", "sum_ms")

    def __init__(self) -> None:
        self.counts = np.zeros(_N + 2, np.int64)
        self.max_ms = 0.0
        self.sum_ms = 0.0

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def add(self, ms: float) -> None:
        ms = float(ms)
        if not math.isfinite(ms):
            return
        self.counts[int(np.searchsorted(EDGES, ms, side="right"))] += 1
        self.max_ms = max(self.max_ms, ms)
        self.sum_ms += ms

    def merge(self, other: "LatencyHistogram") -> "LatencyHistogram":
        self.counts += other.counts
        self.max_ms = max(self.max_ms, other.max_ms)
        self.sum_ms += other.sum_ms
        return self

    def copy(self) -> "LatencyHistogram":
        return LatencyHistogram().merge(self)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) in ms, or None without samples: the geometric middle of the
        bin holding the sample of rank ceil(q n) (the largest value for q = 1)."""
        n = self.n
        if n == 0:
            return None
        if q >= 1.0:
            return self.max_ms
        rank = max(1, math.ceil(q * n))
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        if i == 0:
            return float(EDGES[0])
        if i > _N:
            return float(EDGES[-1])
        return min(float(math.sqrt(EDGES[i - 1] * EDGES[i])), self.max_ms)

    def summary(self, prefix: str = "act") -> dict[str, float | int | None]:
        """``{prefix}_p50_ms``, ``_p90_ms``, ``_p99_ms``, ``_max_ms``, ``_mean_ms`` (rounded to 0.01
        ms; None without samples) and ``{prefix}s_timed`` (the number of samples)."""
        n = self.n

        def r(v):
            return None if v is None else round(float(v), 2)

        return {f"{prefix}_p50_ms": r(self.quantile(0.5)), f"{prefix}_p90_ms": r(self.quantile(0.9)),
                f"{prefix}_p99_ms": r(self.quantile(0.99)), f"{prefix}_max_ms": r(self.max_ms) if n else None,
                f"{prefix}_mean_ms": r(self.sum_ms / n) if n else None, f"{prefix}s_timed": n}

    def to_dict(self) -> dict:
        """The non-empty bins as ``{"lo_ms", "per_decade", "bins": {index: count}, "max_ms",
        "sum_ms"}`` (JSON), read back by :meth:`from_dict`."""
        nz = np.flatnonzero(self.counts)
        return {"lo_ms": LO_MS, "per_decade": PER_DECADE, "bins": {str(int(i)): int(self.counts[i]) for i in nz},
                "max_ms": round(self.max_ms, 3), "sum_ms": round(self.sum_ms, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyHistogram":
        if float(d.get("lo_ms", LO_MS)) != LO_MS or int(d.get("per_decade", PER_DECADE)) != PER_DECADE:
            raise ValueError(f"a latency histogram of other bins ({d.get('lo_ms')} ms, {d.get('per_decade')} "
                             f"a decade) than this Tandem's ({LO_MS} ms, {PER_DECADE})")
        h = cls()
        for i, c in d.get("bins", {}).items():
            h.counts[int(i)] += int(c)
        h.max_ms, h.sum_ms = float(d.get("max_ms", 0.0)), float(d.get("sum_ms", 0.0))
        return h
