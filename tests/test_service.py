"""The learner's socket thread and inference thread over real loopback sockets."""

import time

import numpy as np
import pytest
import torch
import zmq

from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.codec import decode, encode
from data.replay import ReplayBuffer
from data.core.transitions import TransitionBatch
from data.core.spec import EnvSpec
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"front": (8, 8, 3)})
HASH = "cafe"


@pytest.fixture
def learner(ports):
    ctx = zmq.Context()
    ingest = Ingest(ReplayBuffer(1000, SPEC))
    policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8), SPEC)
    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=ingest,
                         submit_act=lambda r: box["inf"].submit(r),
                         get_version=lambda: box["w"].version, get_weights=lambda: box["w"].latest(),
                         port=ports[0], pub_port=ports[1], max_message_bytes=1 << 20)
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"), batch_window_ms=500.0)
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(policy.trainable_state_dict(), version=7)
    svc.start()
    inf.start()
    yield svc, inf, ingest, ctx
    inf.stop()
    svc.stop()
    inf.join(2)
    svc.join(2)
    ctx.destroy(0)


def dealer(ctx, port):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def rpc(sock, frames, timeout=5.0):
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), "no reply"
    return decode(sock.recv_multipart())


def hello(sock, actor_id="a0", config_hash=HASH):
    return rpc(sock, encode("hello", {"actor_id": actor_id, "config_hash": config_hash, "resend_from": 0}))


def obs(n=1):
    return {"observation.state": np.zeros((n, 4), np.float32),
            "observation.images.front": np.zeros((n, 8, 8, 3), np.uint8)}


def records(n, episode=0, start=0, last=False):
    recs = []
    for i in range(n):
        recs.append({"observation.state": np.full(4, i, np.float32),
                     "observation.images.front": np.zeros((8, 8, 3), np.uint8),
                     "action": np.zeros(2, np.float32), "reward": 1.0, "terminated": False,
                     "truncated": False, "intervened": False, "is_last": last and i == n - 1,
                     "success": False, "policy_version": 7, "episode": episode, "step": start + i,
                     "task": ""})
    return recs


def test_bad_frames_get_errors_and_the_server_keeps_serving(learner):
    svc, _, _, ctx = learner
    s = dealer(ctx, svc.port)
    for bad, code in [([b"\x00garbage"], "bad_message"),
                      ([b"x" * (512 << 10)] * 3, "message_too_large")]:  # 1.5 MiB over 1 MiB
        r = rpc(s, bad)
        assert r.type == "error" and r["code"] == code
    # one frame over the limit: the gate's libzmq drops the connection before buffering it
    s.send_multipart([b"x" * (2 << 20)])
    assert not s.poll(1000)
    r = rpc(s, encode("ping", {"t": 1.0}))
    assert r.type == "error" and r["code"] == "handshake_required"
    assert hello(s).type == "welcome"
    r = rpc(s, encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]},
                      {"observation.state": np.zeros((1, 5), np.float32)}))
    assert r.type == "error" and r["code"] == "bad_observation" and "observation.state" in r["message"]
    r = rpc(s, encode("act", {"req_id": 2, "deterministic": False, "tasks": [""]},
                      {"observation.state": np.zeros((1, 4), np.float32)}))
    assert r["code"] == "bad_observation" and "missing 'observation.images.front'" in r["message"]
    bad_state = obs()
    bad_state["observation.state"][0, 0] = np.nan
    r = rpc(s, encode("act", {"req_id": 3, "deterministic": False, "tasks": [""]}, bad_state))
    assert r["code"] == "bad_observation" and "NaN" in r["message"]
    r = rpc(s, encode("act", {"req_id": 4, "deterministic": True, "tasks": [""]}, obs()))
    assert r.type == "act_reply" and r["req_id"] == 4 and r["policy_version"] == 7
    assert r.arrays["actions"].shape == (1, 1, 2)
    assert svc.counters["rejected"] >= 5


def test_config_mismatch_is_refused_with_both_hashes(learner):
    svc, _, _, ctx = learner
    r = hello(dealer(ctx, svc.port), config_hash="beef")
    assert r.type == "error" and r["code"] == "config_mismatch"
    assert "beef" in r["message"] and HASH in r["message"]


def test_concurrent_requests_from_n_actors_run_as_one_batch(learner):
    svc, inf, _, ctx = learner
    n = 4
    socks = [dealer(ctx, svc.port) for _ in range(n)]
    for i, s in enumerate(socks):
        assert hello(s, actor_id=f"a{i}").type == "welcome"
    batches_before = inf.batches
    for i, s in enumerate(socks):
        s.send_multipart(encode("act", {"req_id": i, "deterministic": False, "tasks": [""]}, obs()))
    replies = []
    for s in socks:
        assert s.poll(5000)
        replies.append(decode(s.recv_multipart()))
    assert [r["req_id"] for r in replies] == list(range(n))
    assert all(r["batch"] == n and r["policy_version"] == 7 for r in replies)
    assert inf.batches == batches_before + 1


def test_new_weights_change_the_version_on_replies(learner):
    svc, inf, _, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    inf.set_weights(8, {k: torch.zeros_like(v) for k, v in inf.policy.trainable_state_dict().items()})
    r = rpc(s, encode("act", {"req_id": 1, "deterministic": True, "tasks": [""]}, obs()))
    assert r["policy_version"] == 8


def test_transitions_are_acked_and_duplicates_dropped(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    b0 = TransitionBatch.from_records("a0", 0, records(5))
    r = rpc(s, b0.to_frames())
    assert r.type == "ack" and r["acked_seq"] == 4
    assert ingest.sink.total_added == 5
    # a resend after a reconnect overlaps: only new records are stored
    b1 = TransitionBatch.from_records("a0", 3, records(4, start=3))
    r = rpc(s, b1.to_frames())
    assert r["acked_seq"] == 6 and ingest.sink.total_added == 7
    assert svc.counters["duplicates"] == 2
    # an exact duplicate is acked again and stores nothing
    r = rpc(s, b1.to_frames())
    assert r["acked_seq"] == 6 and ingest.sink.total_added == 7
    # a gap is refused
    gap = TransitionBatch.from_records("a0", 20, records(2))
    r = rpc(s, gap.to_frames())
    assert r.type == "error" and "sequence gap" in r["message"]
    assert ingest.sink.total_added == 7


def test_invalid_transitions_are_consumed_not_stored(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    recs = records(3)
    recs[1]["reward"] = float("inf")
    r = rpc(s, TransitionBatch.from_records("a0", 0, recs).to_frames())
    assert r.type == "batch_rejected" and "reward: contains NaN or Inf" in r["message"]
    assert (r["first_seq"], r["last_seq"]) == (0, 2)
    assert s.poll(2000)
    ack = decode(s.recv_multipart())
    assert ack.type == "ack" and ack["acked_seq"] == 2
    assert ingest.sink.total_added == 0 and sum(ingest.rejections.values()) == 1
    r = rpc(s, TransitionBatch.from_records("a0", 3, records(2)).to_frames())
    assert r.type == "ack" and r["acked_seq"] == 4 and ingest.sink.total_added == 2


def test_batch_claiming_another_actor_is_refused(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s, actor_id="a0")
    r = rpc(s, TransitionBatch.from_records("someone-else", 0, records(2)).to_frames())
    assert r.type == "error" and r["code"] == "bad_actor"
    assert ingest.sink.total_added == 0


def test_weights_on_request_and_on_pub(learner):
    svc, _, _, ctx = learner
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{svc.pub_port}")
    time.sleep(0.3)  # PUB/SUB joins asynchronously
    s = dealer(ctx, svc.port)
    hello(s)
    r = rpc(s, encode("get_weights", {"have_version": -1}))
    assert r.type == "weights" and r["policy_version"] == 7 and len(r.arrays) > 0
    svc.publish(encode("weights", {"policy_version": 9}, {"w": np.ones(3, np.float32)}))
    # the fixture's version 7 may still be on its way to a subscriber that joined late: the
    # broadcast must bring version 9 next, nothing else
    seen = []
    while sub.poll(3000):
        seen.append(decode(sub.recv_multipart())["policy_version"])
        if seen[-1] == 9:
            break
    assert seen and seen[-1] == 9 and set(seen[:-1]) <= {7}, seen
    sub.close(0)


def test_non_loopback_bind_needs_keys(ports):
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without CURVE keys"):
            LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(10, SPEC)),
                           submit_act=lambda r: None, get_version=lambda: 0, get_weights=lambda: None,
                           host="0.0.0.0", port=ports[0], pub_port=ports[1])
    finally:
        ctx.destroy(0)


# -- policy extras on the act reply ------------------------------------------------------------
def test_act_reply_carries_the_policys_extras(learner):
    svc, inf, _, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    rng = np.random.default_rng(0)
    o = {"observation.state": rng.standard_normal((1, 4)).astype(np.float32),
         "observation.images.front": rng.integers(0, 256, (1, 8, 8, 3), dtype=np.uint8)}
    r = rpc(s, encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]}, o))
    assert r.type == "act_reply"
    assert set(r.arrays) == {"actions", "extra.log_prob", "extra.noise"}
    assert r.arrays["extra.log_prob"].dtype == np.float32 and r.arrays["extra.log_prob"].shape == (1,)
    assert r.arrays["extra.noise"].dtype == np.float32 and r.arrays["extra.noise"].shape == (1, 1, 2)
    # the log_prob is the density of the returned action under the serving weights
    t = {k: torch.from_numpy(np.array(v)) for k, v in o.items()}
    expect = inf.policy.log_prob(t, torch.from_numpy(np.array(r.arrays["actions"]))).detach().numpy()
    np.testing.assert_allclose(r.arrays["extra.log_prob"], expect, rtol=1e-3, atol=1e-3)
    assert np.abs(r.arrays["extra.noise"]).sum() > 0
    # deterministic: the mean action, noise zeros, still a log_prob
    r = rpc(s, encode("act", {"req_id": 2, "deterministic": True, "tasks": [""]}, o))
    assert (r.arrays["extra.noise"] == 0).all() and np.isfinite(r.arrays["extra.log_prob"]).all()


def test_each_request_gets_its_own_rows_of_the_extras(learner):
    svc, inf, _, ctx = learner
    socks = [dealer(ctx, svc.port) for _ in range(3)]
    for i, s in enumerate(socks):
        hello(s, actor_id=f"a{i}")
    rng = np.random.default_rng(1)
    obs_i = [{"observation.state": rng.standard_normal((n, 4)).astype(np.float32),
              "observation.images.front": rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)}
             for n in (1, 2, 1)]
    for i, s in enumerate(socks):
        s.send_multipart(encode("act", {"req_id": i, "deterministic": False,
                                        "tasks": [""] * len(obs_i[i]["observation.state"])}, obs_i[i]))
    for i, s in enumerate(socks):
        assert s.poll(5000)
        r = decode(s.recv_multipart())
        n = len(obs_i[i]["observation.state"])
        assert r["batch"] == 3 and r.arrays["extra.log_prob"].shape == (n,)
        t = {k: torch.from_numpy(np.array(v)) for k, v in obs_i[i].items()}
        expect = inf.policy.log_prob(t, torch.from_numpy(np.array(r.arrays["actions"]))).detach().numpy()
        np.testing.assert_allclose(r.arrays["extra.log_prob"], expect, rtol=1e-3, atol=1e-3)


class _Undeclared(MLPPolicy):
    """Returns ``noise`` without declaring it."""

    def extras_spec(self):
        return {"log_prob": ("float32", ())}


class _Missing(MLPPolicy):
    """Declares a ``value`` it never returns."""

    def extras_spec(self):
        return {**super().extras_spec(), "value": ("float32", ())}


@pytest.mark.parametrize("cls, name", [(_Undeclared, "noise"), (_Missing, "value")])
def test_extras_that_do_not_match_the_declaration_are_an_inference_error(cls, name, ports):
    ctx = zmq.Context()
    policy = cls(MLPPolicyConfig(hidden_dims=(8,), cnn_channels=(4,), image_embed_dim=8), SPEC)
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(10, SPEC)),
                         submit_act=lambda r: inf.submit(r), get_version=lambda: 0,
                         get_weights=lambda: None, port=ports[0], pub_port=ports[1])
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"))
    svc.start()
    inf.start()
    try:
        s = dealer(ctx, svc.port)
        hello(s)
        r = rpc(s, encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]}, obs()))
        assert r.type == "error" and r["code"] == "inference_failed" and repr(name) in r["message"]
        assert inf.is_alive()  # serving goes on
    finally:
        inf.stop()
        svc.stop()
        inf.join(2)
        svc.join(2)
        ctx.destroy(0)


# -- transition validation of extras and the chunk/group columns --------------------------------
XSPEC = SPEC.with_extras({"log_prob": ("float32", ()), "noise": ("float32", (3, 2)),
                          "tokens": ("int64", (3,))})


def xrecords(n):
    recs = records(n)
    for i, r in enumerate(recs):
        r.update({"extra.log_prob": np.float32(-i), "extra.noise": np.ones((3, 2), np.float32),
                  "extra.tokens": np.arange(3, dtype=np.int64), "chunk_start": i % 3 == 0,
                  "chunk_index": i % 3, "group_id": 5})
    return recs


def test_transitions_must_carry_exactly_the_declared_extras():
    from data.core.transitions import TransitionError

    TransitionBatch.from_records("a0", 0, xrecords(4)).validate(XSPEC)
    b = TransitionBatch.from_records("a0", 0, xrecords(4))
    assert b.arrays["extra.noise"].shape == (4, 3, 2) and b.arrays["group_id"].tolist() == [5] * 4

    def bad(edit, match):
        recs = xrecords(4)
        edit(recs)
        with pytest.raises(TransitionError, match=match):
            TransitionBatch.from_records("a0", 0, recs).validate(XSPEC)

    def drop(k):
        return lambda recs: [r.pop(k) for r in recs]

    def put(k, v):
        return lambda recs: [r.__setitem__(k, v) for r in recs]

    bad(drop("extra.noise"), "missing array 'extra.noise'")
    bad(put("extra.value", np.float32(0)), r"unexpected arrays \['extra.value'\]")
    bad(put("extra.noise", np.ones((2, 3), np.float32)), r"extra.noise: shape \(4, 2, 3\)")
    bad(put("extra.noise", np.ones((3, 2), np.float64)), "extra.noise: dtype float64")
    bad(put("extra.tokens", np.zeros(3, np.int32)), "extra.tokens: dtype int32")
    bad(put("extra.log_prob", np.float32(np.nan)), "extra.log_prob: contains NaN")
    bad(put("chunk_index", -1), "chunk_index: values must be >= 0")
    bad(put("group_id", -2), "group_id: values must be >= -1")
    b = TransitionBatch.from_records("a0", 0, xrecords(4))
    b.arrays["chunk_start"] = b.arrays["chunk_start"].astype(np.int64)  # as a peer might send it
    with pytest.raises(TransitionError, match="chunk_start: dtype int64, expected bool"):
        b.validate(XSPEC)
    # a spec without extras takes records without them (the chunk/group columns default)
    b = TransitionBatch.from_records("a0", 0, records(2))
    b.validate(SPEC)
    assert b.arrays["chunk_start"].all() and (b.arrays["group_id"] == -1).all()
    with pytest.raises(TransitionError, match="missing array 'extra.log_prob'"):
        b.validate(XSPEC)


def test_extras_transitions_through_the_socket_are_checked_against_the_spec(ports):
    ctx = zmq.Context()
    ingest = Ingest(ReplayBuffer(100, XSPEC))
    svc = LearnerService(ctx=ctx, spec=XSPEC, config_hash=HASH, ingest=ingest,
                         submit_act=lambda r: None, get_version=lambda: 0,
                         get_weights=lambda: None, port=ports[0], pub_port=ports[1])
    svc.start()
    try:
        s = dealer(ctx, svc.port)
        w = hello(s)
        assert w["spec"]["extras"] == {"log_prob": ["float32", []], "noise": ["float32", [3, 2]],
                                       "tokens": ["int64", [3]]}
        assert EnvSpec.from_dict(w["spec"]) == XSPEC and w["jobs"] is False
        r = rpc(s, TransitionBatch.from_records("a0", 0, xrecords(3)).to_frames())
        assert r.type == "ack" and r["acked_seq"] == 2 and ingest.sink.total_added == 3
        recs = xrecords(2)
        for rec in recs:
            del rec["extra.tokens"]
        r = rpc(s, TransitionBatch.from_records("a0", 3, recs).to_frames())
        assert r.type == "batch_rejected" and "missing array 'extra.tokens'" in r["message"]
        assert ingest.sink.total_added == 3
    finally:
        svc.stop()
        svc.join(2)
        ctx.destroy(0)


# -- jobs ----------------------------------------------------------------------------------
def test_get_job_hands_out_the_queue_in_order_and_repeats_an_episodes_job(ports):
    from data.core.jobs import Job
    from learner.jobs import JobQueue

    q = JobQueue.from_config([{"task_id": 0, "init_state": 3, "seed": 11, "group_id": 7},
                              {"task_id": 1, "init_state": 4, "seed": 12, "group_id": 7,
                               "deterministic": True}])
    ctx = zmq.Context()
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(10, SPEC)),
                         submit_act=lambda r: None, get_version=lambda: 0, get_weights=lambda: None,
                         port=ports[0], pub_port=ports[1], next_job=q.next_job)
    svc.start()
    try:
        a, b = dealer(ctx, svc.port), dealer(ctx, svc.port)
        assert hello(a, "a")["jobs"] is True and hello(b, "b")["jobs"] is True
        r = rpc(a, encode("get_job", {"episode": 0}))
        assert r.type == "job" and r["episode"] == 0
        assert Job.from_fields(r) == Job(0, task_id=0, init_state=3, seed=11, group_id=7)
        again = rpc(a, encode("get_job", {"episode": 0}))  # a retry gets the same job
        assert Job.from_fields(again) == Job.from_fields(r)
        r = rpc(b, encode("get_job", {"episode": 0}))
        assert Job.from_fields(r) == Job(1, task_id=1, init_state=4, seed=12, group_id=7, deterministic=True)
        assert q.pending() == 0 and set(q.assigned) == {("a", 0), ("b", 0)}
        r = rpc(a, encode("get_job", {"episode": 1}))
        assert r.type == "no_job" and r["episode"] == 1
        r = rpc(a, encode("get_job", {"episode": -3}))
        assert r.type == "error" and r["code"] == "bad_request"
        q.put(Job(9, seed=1))
        assert Job.from_fields(rpc(b, encode("get_job", {"episode": 1}))).job_id == 9
        assert svc.counters["jobs"] == 4
    finally:
        svc.stop()
        svc.join(2)
        ctx.destroy(0)


def test_without_a_job_source_the_welcome_says_no_jobs(learner):
    svc, _, _, ctx = learner
    s = dealer(ctx, svc.port)
    assert hello(s)["jobs"] is False
    r = rpc(s, encode("get_job", {"episode": 0}))
    assert r.type == "no_job" and r["episode"] == 0


def test_job_queue_config_errors_name_the_entry():
    from learner.jobs import JobQueue

    with pytest.raises(ValueError, match=r"jobs\[1\]: unknown key\(s\) \['init'\]"):
        JobQueue.from_config([{"seed": 1}, {"init": 2}])
    with pytest.raises(ValueError, match=r"jobs\[0\]: job seed must be an int"):
        JobQueue.from_config([{"seed": -1}])
    q = JobQueue.from_config([{"seed": 1}, {"seed": 2, "job_id": 40}])
    assert q.next_job("x", 0).job_id == 0 and q.next_job("x", 1).job_id == 40
    assert q.next_job("x", 2) is None and q.pending() == 0


def test_acks_of_a_burst_are_coalesced_and_come_before_other_replies(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    for i in range(6):  # six batches back to back, then a ping: nothing read in between
        s.send_multipart(TransitionBatch.from_records("a0", 2 * i, records(2, start=2 * i)).to_frames())
    s.send_multipart(encode("ping", {"t": 1.0}))
    got = []
    while not got or got[-1].type != "pong":
        assert s.poll(5000), f"no reply after {[m.type for m in got]}"
        got.append(decode(s.recv_multipart()))
    acks = [m["acked_seq"] for m in got if m.type == "ack"]
    assert acks and acks == sorted(acks) and acks[-1] == 11, acks  # cumulative, in order
    assert [m.type for m in got][-1] == "pong" and ingest.sink.total_added == 12
