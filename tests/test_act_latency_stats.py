"""Act latency percentiles over a whole run: the histogram (data/core/latency.py), the learner's
per-actor and all-actor figures (learner/actor_stats.py) in ``status.json`` and every
``metrics.jsonl`` line, and each actor's own round trip (actor/client.py), checked against
each other on a real learner and actor: the server-side time of an act is inside the actor's
round trip, so the learner's p50 cannot exceed the actor's."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from data.core.latency import LatencyHistogram
from learner.actor_stats import ActorStats
from tandem_testutil import ROOT, free_port


def test_histogram_percentiles_merge_and_json_round_trip():
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(3.0, 0.6, 5000), rng.lognormal(2.0, 1.0, 3000)  # ms
    ha, hb = LatencyHistogram(), LatencyHistogram()
    for x in a:
        ha.add(x)
    for x in b:
        hb.add(x)
    both = np.concatenate([a, b])
    pooled = ha.copy().merge(hb)
    assert pooled.n == 8000 and pooled.max_ms == pytest.approx(both.max())
    for q in (0.5, 0.9, 0.99):
        exact = np.quantile(both, q, method="inverted_cdf")
        assert pooled.quantile(q) == pytest.approx(exact, rel=0.025), q   # half a bin (4.7%) at most
    s = pooled.summary("act")
    assert s["acts_timed"] == 8000 and s["act_mean_ms"] == pytest.approx(both.mean(), abs=0.006)
    assert s["act_p50_ms"] <= s["act_p90_ms"] <= s["act_p99_ms"] <= s["act_max_ms"]
    back = LatencyHistogram.from_dict(json.loads(json.dumps(pooled.to_dict())))
    assert np.array_equal(back.counts, pooled.counts) and back.quantile(0.99) == pooled.quantile(0.99)
    empty = LatencyHistogram()
    assert empty.quantile(0.5) is None and empty.summary()["act_p99_ms"] is None
    edge = LatencyHistogram()
    for x in (1e-4, 5.0, 1e7, float("nan")):   # below and above the bins, and a NaN (ignored)
        edge.add(x)
    assert edge.n == 3 and edge.quantile(1.0) == 1e7 and edge.quantile(0.01) == pytest.approx(0.01)


def test_actor_stats_report_p50_p99_per_actor_over_all_and_per_period(monkeypatch):
    import learner.actor_stats as mod

    stats = ActorStats()
    now = [100.0]
    monkeypatch.setattr(mod.time, "perf_counter", lambda: now[0])

    def act(actor: str, ident: bytes, ms: float):
        stats.on_act(actor, ident, now[0] - ms / 1000.0)
        stats.on_reply(ident)

    for i in range(99):
        act("a0", b"x", 10.0)
    act("a0", b"x", 500.0)                     # one slow act of 100: a0's p99 is 10 ms, its max 500
    for i in range(100):
        act("a1", b"y", 30.0)
    run = stats.act_latency()
    assert run["acts_timed"] == 200
    assert run["act_p50_ms"] == pytest.approx(30.0, rel=0.025)   # the 100th of 200: 99 at 10, then 30s
    assert run["act_p99_ms"] == pytest.approx(30.0, rel=0.025) and run["act_max_ms"] == 500.0
    period = stats.take_period()
    assert period["acts_recent"] == 200 and period["act_p99_ms_recent"] == pytest.approx(30.0, rel=0.025)
    assert stats.take_period() == {"act_p50_ms_recent": None, "act_p99_ms_recent": None, "acts_recent": 0}
    act("a1", b"y", 50.0)
    assert stats.take_period()["act_p50_ms_recent"] == pytest.approx(50.0, rel=0.025)
    rows = {r["actor"]: r for r in stats.rows(peers={}, peer_timeout_s=5.0, version=0, received={}, acked={})}
    assert rows["a0"]["acts"] == 100 and rows["a0"]["act_p50_ms"] == 10.0
    assert rows["a0"]["act_p99_ms"] == pytest.approx(10.0 + 0.01 * 490, rel=0.01)   # numpy's, last 200
    assert rows["a0"]["act_p99_ms_run"] == pytest.approx(10.0, rel=0.025)
    assert rows["a1"]["act_p50_ms_run"] == pytest.approx(30.0, rel=0.025)
    hists = stats.act_histograms()
    assert set(hists) == {"all", "a0", "a1"} and LatencyHistogram.from_dict(hists["all"]).n == 201


def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=overrides)


def test_a_real_run_reports_act_percentiles_in_status_metrics_and_the_actor(tmp_path):
    from actor.app import Actor
    from learner.app import Learner

    run_dir = tmp_path / "run"
    common = [f"run_dir={run_dir}", f"transport.port={free_port()}", f"transport.pub_port={free_port()}",
              "transport.timeout_s=2.0", "transport.heartbeat_s=0.5", "env=point_reach", "env.num_tasks=1",
              "~env.cameras", "+env.cameras={}", "env.state_has_target=true", "policy=mlp",
              "policy.hidden_dims=[16]", "policy.chunk_size=1"]
    learner = Learner(_compose("learner", common + [
        "algo=sac", "algo.learning_starts=100000", "device=cpu", "logging.wandb=disabled", "logging.every_s=0.3",
        "logging.live=false", "trainer.num_threads=1", "buffer.persist=false"]))
    th = threading.Thread(target=learner.run, daemon=True)
    th.start()
    try:
        actor = Actor(_compose("actor", common + ["actor_id=a0", "spool.fsync=false", "max_episodes=6",
                                                  "drain_s=10", "live=false"]))
        actor.run()
        time.sleep(0.8)                        # a logging tick after the last act
    finally:
        learner.stop()
        th.join(60)
    mine = actor.client.act_hist
    st = json.loads((run_dir / "status.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"\nserver act p50 {st['act_p50_ms']} p99 {st['act_p99_ms']} over {st['acts_timed']}; actor round "
          f"trip p50 {mine.quantile(0.5):.2f} p99 {mine.quantile(0.99):.2f} over {mine.n}")
    assert mine.n >= 6 and st["acts_timed"] >= mine.n
    assert 0 < st["act_p50_ms"] <= st["act_p99_ms"] <= st["act_max_ms"]
    assert st["act_p50_ms"] <= mine.quantile(0.5) * 1.03      # the server's part of each round trip
    assert st["actors_table"][0]["acts"] == st["acts_timed"] and st["act_latency_hist"]["all"]["bins"]
    last = rows[-1]
    assert last["act_p50_ms"] == st["act_p50_ms"] and last["acts_timed"] == st["acts_timed"]
    assert any(r.get("act_p99_ms_recent") is not None for r in rows) and all("acts_recent" in r for r in rows)
    s = actor.client.stats()
    assert s["acts_timed"] == mine.n and s["act_p99_ms"] >= s["act_p50_ms"] > 0
