"""The learner's act socket (learner/act_channel.py): acts answered by the inference thread on
a socket of their own, with the same validation as the main socket, over real loopback."""

import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from actor.client import LearnerClient
from actor.spool import Spool
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.codec import decode, encode
from data.core.spec import EnvSpec
from data.replay import ReplayBuffer
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"front": (8, 8, 3)})
HASH = "cafe"


def obs(n=1, seed=0):
    rng = np.random.default_rng(seed)
    return {"observation.state": rng.standard_normal((n, 4)).astype(np.float32),
            "observation.images.front": rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)}


class SlowPolicy(MLPPolicy):
    """The MLP, with every act taking ``delay_s``, or the next ``delays`` first (a policy slower
    than its callers' patience)."""

    delay_s = 0.0
    delays: tuple[float, ...] = ()

    def act(self, *args, **kwargs):
        delay = self.delay_s
        if self.delays:
            delay, *rest = self.delays
            self.delays = tuple(rest)
        time.sleep(delay)
        return super().act(*args, **kwargs)


@pytest.fixture
def learner():
    ctx = zmq.Context()
    policy = SlowPolicy(MLPPolicyConfig(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8), SPEC)
    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(100, SPEC)),
                         submit_act=lambda r: box["inf"].submit(r), get_version=lambda: 0,
                         get_weights=lambda: None, port=0, pub_port=0, max_message_bytes=1 << 20)
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"), act_channel=svc.act_channel)
    box["inf"] = inf
    svc.start()
    inf.start()
    yield svc, inf, ctx
    inf.stop()
    svc.stop()
    inf.join(2)
    svc.join(2)
    ctx.destroy(0)


def sock(ctx, port, routing_id=None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def rpc(s, frames):
    s.send_multipart(frames)
    assert s.poll(5000), "no reply"
    return decode(s.recv_multipart())


def hello(s, actor_id="a0"):
    return rpc(s, encode("hello", {"actor_id": actor_id, "config_hash": HASH, "resend_from": 0}))


def act(req_id=1, o=None, tasks=("",)):
    return encode("act", {"req_id": req_id, "deterministic": True, "tasks": list(tasks)}, o or obs())


def test_client_acts_through_the_act_socket_and_main_socket_still_serves(learner):
    svc, inf, ctx = learner
    with tempfile.TemporaryDirectory() as tmp:
        cl = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0", config_hash=HASH,
                           spool=Spool(Path(tmp) / "s", fsync=False), timeout_s=5.0)
        cl.connect(give_up_after_s=10)
        assert cl.act_sock is not None  # the welcome named the act socket
        actions, _, _ = cl.act(obs(), [""], deterministic=True)
        assert actions.shape[0] == 1 and actions.shape[-1] == SPEC.action_dim
        acts_before = svc.counters["acts"]
        for i in range(5):
            cl.act(obs(seed=i), [""], deterministic=True)
        assert svc.counters["acts"] == acts_before + 5
        # the same request on the main socket gives the same actions (same policy, deterministic)
        main = sock(ctx, svc.port)
        assert hello(main, "a1").type == "welcome"
        r = rpc(main, act(7))
        assert r.type == "act_reply" and r["req_id"] == 7
        np.testing.assert_allclose(r.arrays["actions"], actions, atol=1e-6)
        cl.close()


def test_act_socket_refuses_strangers_and_bad_requests_and_keeps_serving(learner):
    svc, inf, ctx = learner
    port = svc.act_channel.port
    stranger = sock(ctx, port, b"\x01" + b"x" * 15)
    r = rpc(stranger, act())
    assert r.type == "error" and r["code"] == "handshake_required"
    anon = sock(ctx, port)  # no routing id at all
    assert rpc(anon, act())["code"] == "handshake_required"

    main = sock(ctx, svc.port)
    w = hello(main)
    assert w["act_port"] == port and len(w["act_token"]) == 16
    s = sock(ctx, port, w["act_token"])
    rejected = svc.counters["rejected"]
    cases = [
        ([b"\x92garbage"], "bad_message"),  # not msgpack
        (encode("ping", {"t": 0.0}), "unexpected_type"),  # only act here
        (act(o={"observation.state": np.zeros((1, 4), np.float32)}), "bad_observation"),  # no camera
        (act(o={**obs(), "observation.state": np.full((1, 4), np.nan, np.float32)}), "bad_observation"),
        (act(tasks=["a", "b"]), "bad_observation"),  # 2 tasks for 1 observation
        (encode("act", {"req_id": -1, "deterministic": True, "tasks": [""]}, obs()), "bad_request"),
    ]
    for frames, code in cases:
        r = rpc(s, frames)
        assert r.type == "error" and r["code"] == code, (code, r.fields)
    assert svc.counters["rejected"] == rejected + len(cases)
    r = rpc(s, act(3))  # still serving
    assert r.type == "act_reply" and r["req_id"] == 3
    # a new hello replaces the session: the old token is refused from now on
    w2 = hello(main)
    assert w2["act_token"] != w["act_token"]
    assert rpc(s, act(4))["code"] == "handshake_required"
    assert rpc(sock(ctx, port, w2["act_token"]), act(5))["req_id"] == 5


def test_main_socket_refuses_a_token_shaped_routing_id(learner):
    svc, _, ctx = learner
    r = hello(sock(ctx, svc.port, b"\x02" * 16))
    assert r.type == "error" and r["code"] == "bad_hello"


def test_without_a_claimed_act_socket_the_welcome_names_none(ports):
    ctx = zmq.Context()
    try:
        svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(10, SPEC)),
                             submit_act=lambda r: None, get_version=lambda: 0, get_weights=lambda: None,
                             port=0, pub_port=0)
        svc.start()
        w = hello(sock(ctx, svc.port))
        assert w["act_port"] == 0 and w["act_token"] == b""
        svc.stop()
        svc.join(2)
    finally:
        ctx.destroy(0)


def test_a_request_superseded_by_its_senders_resend_is_dropped_unserved(learner):
    """A client waits for its latest request only (it resends after its timeout with a new
    req_id and drops late replies): a queued request with a newer one from the same sender
    behind it is dropped, not served, so under overload the device serves the resends."""
    svc, inf, ctx = learner
    inf.policy.delays = (0.5,)
    peers = []
    for i in range(3):
        main = sock(ctx, svc.port)
        peers.append(sock(ctx, svc.act_channel.port, hello(main, f"a{i}")["act_token"]))
    first, resender, other = peers
    first.send_multipart(act(1))  # occupies the server for 0.5 s
    time.sleep(0.15)
    for req_id in (7, 8, 9):      # a client resending while the server is busy
        resender.send_multipart(act(req_id))
    other.send_multipart(act(7))  # another sender's request with the same id is its own
    assert first.poll(5000) and decode(first.recv_multipart())["req_id"] == 1
    assert resender.poll(5000) and decode(resender.recv_multipart())["req_id"] == 9
    assert other.poll(5000) and decode(other.recv_multipart())["req_id"] == 7
    assert not resender.poll(500), "a superseded request was served"
    assert inf.superseded == 2 and inf.served == 3
    # the sender's next request is served as usual
    assert rpc(resender, act(10))["req_id"] == 10
    assert inf.superseded == 2
