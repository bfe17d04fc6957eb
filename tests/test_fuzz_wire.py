"""Property-based fuzzing of the learner's wire against a real service on loopback
(tools/bench/fuzz_wire.py; `python -m tools.bench.fuzz_wire --examples N` for a long run)."""

import pytest
from hypothesis import HealthCheck, given, settings

from tools.bench.fuzz_wire import FuzzTarget, messages


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # with an episode store, as a training learner has (durable acks, staged episodes)
    t = FuzzTarget(store_dir=str(tmp_path_factory.mktemp("fuzz") / "dataset"))
    yield t
    t.close()


@settings(max_examples=500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(fz=messages())
def test_every_message_is_answered_or_dropped_and_nothing_raises_unchecked(target, fz):
    target.check(fz)


def test_a_real_client_is_still_served_after_the_fuzzing(target):
    # runs after the property above, against the same service (module-scoped)
    target.served()
    assert target.svc.is_alive() and target.svc.counters["internal_errors"] == 0


def test_each_attack_class_leaves_the_service_serving(target):
    """tools/bench/fuzz_attacks.py's generators, once each, against the same real service (its wire
    gate included): answered or dropped, never an unchecked exception, still serving."""
    import zmq

    from tools.bench import fuzz_attacks as A
    from tools.bench.fuzz_wire import HASH

    ctx = zmq.Context()
    try:
        port, spec = target.svc.port, target.spec
        act_port = target.svc.act_channel.port
        assert A.routing_ids(ctx, [port, act_port], span=16, randoms=16, triggers=2) > 0
        assert A.float_extremes(ctx, port, spec, HASH) >= 5 * len(spec.float_ranges)
        assert A.id_edges(ctx, port, spec, HASH) > 0
        assert A.huge_frames(ctx, port, limit=target.svc.max_message_bytes) == 3
        assert A.bad_shapes(ctx, port, spec, HASH) == 8
    finally:
        ctx.destroy(0)
    target.served()
    assert target.svc.is_alive() and target.svc.counters["internal_errors"] == 0
    assert target.svc.gate.restarts == 0 or target.svc.gate.alive()
