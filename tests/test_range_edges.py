"""Ids and counters at the edges of their ranges (issue 24, class 5): whatever the learner
accepts leaves every later message encodable. An episode id or sequence number at the top of
its range is refused where it enters, one short of it is accepted, and the actor that sent it
can still handshake (the welcome's ``next_episode`` / the hello's ``resend_from`` fit)."""

import numpy as np

from data.core.codec import decode
from data.core.schema import FIELD_BOUNDS, MAX_SEQ, STEP_BOUNDS
from data.core.transitions import TransitionBatch
from test_wire_hardening import dealer, hello, learner, records, rpc  # noqa: F401  (fixture)


def _batch(actor, first_seq, episode, n=2, step0=0):
    recs = records(n, episode=episode, start=step0)
    return TransitionBatch.from_records(actor, first_seq, recs)


def test_an_episode_id_at_the_top_is_refused_and_one_below_leaves_the_actor_able_to_handshake(learner):
    svc, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    assert hello(s, "edge", instance="one").type == "welcome"
    top = STEP_BOUNDS["episode"][1]
    assert top == MAX_SEQ - 1 and FIELD_BOUNDS["next_episode"][1] == MAX_SEQ
    r = rpc(s, _batch("edge", 0, MAX_SEQ).to_frames())  # the old top: its successor cannot be sent
    assert r.type == "batch_rejected" and "episode" in r["message"], r.fields
    assert ingest.sink.total_added == 0
    r = rpc(s, _batch("edge", 2, top).to_frames())  # (the refused records 0..1 were consumed)
    while r.type != "ack" or r["received_seq"] < 3:  # (the refused batch's ack comes first)
        assert s.poll(3000)
        r = decode(s.recv_multipart())
    assert ingest.sink.total_added == 2 and ingest.max_episode["edge"] == top
    # the same actor again, on a new socket: its welcome (next_episode = top + 1) decodes
    w = hello(dealer(ctx, svc.port), "edge", instance="one")
    assert w.type == "welcome" and w["next_episode"] == MAX_SEQ


def test_sequence_numbers_stop_one_short_of_the_top(learner):
    svc, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    assert hello(s, "seq", resend_from=MAX_SEQ - 2, instance="one").type == "welcome"
    r = rpc(s, _batch("seq", MAX_SEQ - 1, 0).to_frames())  # would end at MAX_SEQ
    assert r.type == "error" and r["code"] == "bad_request" and "last_seq" in r["message"]
    r = rpc(s, _batch("seq", MAX_SEQ - 2, 0).to_frames())  # ends at MAX_SEQ - 1
    while r.type != "ack":
        assert s.poll(3000)
        r = decode(s.recv_multipart())
    assert r["received_seq"] == MAX_SEQ - 1
    w = hello(dealer(ctx, svc.port), "seq", resend_from=MAX_SEQ, instance="one")  # its spool's next
    assert w.type == "welcome" and w["received_seq"] == MAX_SEQ - 1


def test_a_step_at_the_top_is_refused_so_its_final_record_could_follow():
    spec_top = STEP_BOUNDS["step"][1]
    assert spec_top == 2**31 - 2  # the is_last record's step (last + 1) stays an int32
    b = _batch("a", 0, 0, n=1, step0=spec_top + 1)
    assert int(np.asarray(b.arrays["step"]).max()) == 2**31 - 1
