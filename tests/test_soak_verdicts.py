"""tools/bench/soak.py's verdicts: only growth beyond the tolerance fails a soak line."""

import numpy as np

from tools.bench.soak import LINES, verdicts


def rows(series: dict[str, np.ndarray], t: np.ndarray) -> list[dict]:
    return [{"t_s": float(ti), **{k: float(series.get(k, np.full(len(t), 10.0))[i]) for k in LINES}}
            for i, ti in enumerate(t)]


def test_growth_fails_a_fall_is_reported_and_noise_stays_flat():
    t = np.arange(0, 1800, 5.0)
    rng = np.random.default_rng(0)
    v = verdicts(rows({"learner_rss_mb": 900 + 0.2 * t,              # +360 MB: a leak
                       "act_p99_ms": 300 - 0.1 * t,                  # 300 -> 120 ms: falling
                       "actors_rss_mb": 280 + rng.normal(0, 5, len(t))}, t), 60, 0.10)
    assert v["learner_rss_mb"]["flat"] is False
    assert v["act_p99_ms"]["flat"] is True and v["act_p99_ms"]["falling"] is True
    assert v["actors_rss_mb"]["flat"] is True and v["actors_rss_mb"]["falling"] is False
    assert v["learner_threads"]["flat"] is True  # constant
