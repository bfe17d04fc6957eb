"""The learner's socket thread and inference thread over real loopback sockets."""

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.codec import decode, encode
from data.replay import ReplayBuffer
from data.transitions import TransitionBatch
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
    for bad, code in [([b"\x00garbage"], "bad_message"), ([b"x" * (2 << 20)], "bad_message")]:
        r = rpc(s, bad)
        assert r.type == "error" and r["code"] == code
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
    assert ingest.buffer.total_added == 5
    # a resend after a reconnect overlaps: only new records are stored
    b1 = TransitionBatch.from_records("a0", 3, records(4, start=3))
    r = rpc(s, b1.to_frames())
    assert r["acked_seq"] == 6 and ingest.buffer.total_added == 7
    assert svc.counters["duplicates"] == 2
    # an exact duplicate is acked again and stores nothing
    r = rpc(s, b1.to_frames())
    assert r["acked_seq"] == 6 and ingest.buffer.total_added == 7
    # a gap is refused
    gap = TransitionBatch.from_records("a0", 20, records(2))
    r = rpc(s, gap.to_frames())
    assert r.type == "error" and "sequence gap" in r["message"]
    assert ingest.buffer.total_added == 7


def test_invalid_transitions_are_consumed_not_stored(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s)
    recs = records(3)
    recs[1]["reward"] = float("inf")
    r = rpc(s, TransitionBatch.from_records("a0", 0, recs).to_frames())
    assert r.type == "error" and "reward: contains NaN or Inf" in r["message"]
    assert s.poll(2000)
    ack = decode(s.recv_multipart())
    assert ack.type == "ack" and ack["acked_seq"] == 2
    assert ingest.buffer.total_added == 0 and sum(ingest.rejections.values()) == 1
    r = rpc(s, TransitionBatch.from_records("a0", 3, records(2)).to_frames())
    assert r.type == "ack" and r["acked_seq"] == 4 and ingest.buffer.total_added == 2


def test_batch_claiming_another_actor_is_refused(learner):
    svc, _, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    hello(s, actor_id="a0")
    r = rpc(s, TransitionBatch.from_records("someone-else", 0, records(2)).to_frames())
    assert r.type == "error" and r["code"] == "bad_actor"
    assert ingest.buffer.total_added == 0


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
    assert sub.poll(3000)
    m = decode(sub.recv_multipart())
    assert m["policy_version"] == 9
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
