"""No single message takes the learner down; actor ids are owned by one session (or bound to
a CURVE key); resend positions are checked; rejections are counted and their log bounded.
A real LearnerService on loopback sockets throughout."""

import logging
import threading
import time

import msgpack
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
from data.store import EpisodeStore
from data.core.transitions import TransitionBatch
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher
from tools.gen_keys import make_keys

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"front": (8, 8, 3)})
HASH = "cafe"


def make_service(ports, *, ingest=None, security=None, peer_timeout_s=10.0, submit_act=None,
                 on_fatal=None, **service_kw):
    ctx = zmq.Context()
    ingest = ingest or Ingest(ReplayBuffer(1000, SPEC))
    policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8), SPEC)
    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=ingest,
                         submit_act=submit_act or (lambda r: box["inf"].submit(r)),
                         get_version=lambda: box["w"].version, get_weights=lambda: box["w"].latest(),
                         port=ports[0], pub_port=ports[1], max_message_bytes=1 << 20,
                         peer_timeout_s=peer_timeout_s, security=security, on_fatal=on_fatal,
                         **service_kw)
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"), batch_window_ms=1.0)
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(policy.trainable_state_dict(), version=3)
    svc.start()
    inf.start()

    def close():
        inf.stop()
        svc.stop()
        inf.join(2)
        svc.join(2)
        ctx.destroy(0)
    return svc, ingest, ctx, close


@pytest.fixture
def learner(ports):
    svc, ingest, ctx, close = make_service(ports)
    yield svc, ingest, ctx
    close()


def dealer(ctx, port, security=None):
    from data.core.security import configure_client_socket

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    configure_client_socket(s, security or {})
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def rpc(sock, frames, timeout=5.0):
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), "no reply"
    return decode(sock.recv_multipart())


def hello(sock, actor_id="a0", resend_from=0, **extra):
    return rpc(sock, encode("hello", {"actor_id": actor_id, "config_hash": HASH,
                                      "resend_from": resend_from, **extra}))


def raw(header: dict, *buffers: bytes) -> list[bytes]:
    """A hand-made message: any header, any buffers (what an attacker can send)."""
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def obs(n=1):
    return {"observation.state": np.zeros((n, 4), np.float32),
            "observation.images.front": np.zeros((n, 8, 8, 3), np.uint8)}


def records(n, episode=0, start=0):
    return [{"observation.state": np.full(4, i, np.float32),
             "observation.images.front": np.zeros((8, 8, 3), np.uint8),
             "action": np.zeros(2, np.float32), "reward": 1.0, "terminated": False,
             "truncated": False, "intervened": False, "is_last": False, "success": False,
             "policy_version": 3, "episode": episode, "step": start + i, "task": ""}
            for i in range(n)]


def batch_header(first_seq, n, arrays, actor_id="a0", last_seq=None):
    return {"v": 1, "type": "transitions", "actor_id": actor_id, "first_seq": first_seq,
            "last_seq": first_seq + n - 1 if last_seq is None else last_seq, "tasks": [""] * n,
            "arrays": arrays}


def refused(sock, frames):
    """A batch the learner refuses: its typed ``batch_rejected`` (returned), then the ack that
    covers the consumed records."""
    r = rpc(sock, frames)
    assert r.type == "batch_rejected", r.fields
    assert sock.poll(5000), "no ack after the rejection"
    assert decode(sock.recv_multipart()).type == "ack"
    return r


def served(svc, ctx, actor_id="probe"):
    """The learner still answers a real client: hello, act, a batch acked."""
    s = dealer(ctx, svc.port)
    assert hello(s, actor_id).type == "welcome"
    r = rpc(s, encode("act", {"req_id": 1, "deterministic": True, "tasks": [""]}, obs()))
    assert r.type == "act_reply" and r.arrays["actions"].shape == (1, 1, 2)
    r = rpc(s, TransitionBatch.from_records(actor_id, 0, records(3)).to_frames())
    assert r.type == "ack" and r["received_seq"] == 2
    s.close(0)


def test_crafted_messages_each_get_an_error_and_the_learner_keeps_serving(learner):
    svc, ingest, ctx = learner
    s = dealer(ctx, svc.port)
    # before any handshake: a shape numpy refuses (0 * 2**62 elements: zero bytes claimed)
    r = rpc(s, raw({"v": 1, "type": "hello", "actor_id": "x", "config_hash": HASH, "resend_from": 0,
                    "arrays": [["a", "float32", [0, 2**62]]]}, b""))
    assert r.type == "error" and r["code"] == "bad_message" and "shape" in r["message"]
    # protocol 1.0 and true are not protocol 1
    for v in (1.0, True):
        r = rpc(s, raw({"v": v, "type": "ping", "t": 1.0, "arrays": []}))
        assert r["code"] == "bad_message" and "protocol version" in r["message"]
    # a resend position near the int64 limit
    r = rpc(s, raw({"v": 1, "type": "hello", "actor_id": "a0", "config_hash": HASH,
                    "resend_from": 2**63 - 1, "arrays": []}))
    assert r["code"] == "bad_request" and "resend_from" in r["message"]
    assert hello(s).type == "welcome"
    good = TransitionBatch.from_records("a0", 0, records(2))
    meta = [[k, v.dtype.name, list(v.shape)] for k, v in good.arrays.items()]
    bufs = [v.tobytes() for v in good.arrays.values()]
    # a 0-d reward where a batch [N] is expected
    zero_d = [[k, d, [] if k == "reward" else sh] for k, d, sh in meta]
    zbufs = [np.float32(1).tobytes() if m[0] == "reward" else b for m, b in zip(meta, bufs)]
    r = refused(s, raw(batch_header(0, 2, zero_d), *zbufs))
    assert r["code"] == "bad_transitions" and "'reward'" in r["message"]
    # sequence numbers near the int64 limit
    r = rpc(s, raw(batch_header(2**63 - 2, 2, meta), *bufs))
    assert r["code"] == "bad_request" and "first_seq" in r["message"]
    # an episode id near the int64 limit inside the arrays
    big = dict(good.arrays, episode=np.full(2, 2**63 - 1, np.int64))
    r = refused(s, TransitionBatch("a0", 0, big, ["", ""]).to_frames())
    assert r["code"] == "bad_transitions" and "episode" in r["message"]
    # tasks and rows disagree; last_seq disagrees (each refused batch's records are consumed)
    r = refused(s, raw(dict(batch_header(0, 2, meta), tasks=[""] * 3), *bufs))
    assert r["code"] == "bad_transitions"
    r = refused(s, raw(batch_header(0, 2, meta, last_seq=7), *bufs))
    assert r["code"] == "bad_seq" and (r["first_seq"], r["last_seq"]) == (0, 7)
    # an act request whose state is 0-d; a non-finite ping time
    r = rpc(s, encode("act", {"req_id": 1, "deterministic": False, "tasks": [""]},
                      {"observation.state": np.float32(0), "observation.images.front":
                       np.zeros((1, 8, 8, 3), np.uint8)}))
    assert r["code"] == "bad_observation"
    r = rpc(s, raw({"v": 1, "type": "ping", "t": float("nan"), "arrays": []}))
    assert r["code"] == "bad_request"
    assert ingest.sink.total_added == 0 and svc.counters["internal_errors"] == 0
    assert svc.is_alive()
    served(svc, ctx)


def test_an_exception_from_any_handler_is_an_error_reply_and_a_count(ports):
    def broken_submit(req):  # the inference hand-off fails (a bug elsewhere, not the message)
        raise RuntimeError("inference queue is broken")

    svc, _, ctx, close = make_service(ports, submit_act=broken_submit)
    try:
        s = dealer(ctx, svc.port)
        assert hello(s).type == "welcome"
        for i in range(3):
            r = rpc(s, encode("act", {"req_id": i, "deterministic": False, "tasks": [""]}, obs()))
            assert r.type == "error" and r["code"] == "internal_error"
            assert "inference queue is broken" in r["message"]
        assert svc.counters["internal_errors"] == 3 and svc.is_alive()
        assert rpc(s, encode("ping", {"t": 1.0})).type == "pong"
    finally:
        close()


def test_a_socket_thread_that_dies_anyway_reports_its_cause(ports):
    died = []
    got = threading.Event()
    svc, _, ctx, close = make_service(ports, on_fatal=lambda exc: (died.append(exc), got.set()))
    try:
        svc.outbox().send_multipart([b"R"])  # a reply with no frames: a bug in another thread
        assert got.wait(5), "on_fatal was not called"
        svc.join(5)
        assert not svc.is_alive() and svc.error is died[0]
    finally:
        close()


def test_a_flood_of_rejections_is_all_counted_and_its_log_bounded(learner, caplog):
    svc, _, ctx = learner
    s = dealer(ctx, svc.port)
    n = 400
    with caplog.at_level(logging.WARNING, logger="tandem.learner.service"):
        for _ in range(n):
            s.send_multipart([b"\x00garbage"])
        for _ in range(n):
            assert s.poll(5000)
            s.recv_multipart()
    assert svc.counters["rejected"] == n and svc.rejections["bad_message"] == n
    lines = [r for r in caplog.records if r.name == "tandem.learner.service"]
    assert len(lines) <= svc._warn.burst + 1
    assert svc._warn.suppressed_total == n - len(lines)


def test_a_second_session_claiming_a_live_id_is_refused_and_the_real_actor_goes_on(learner):
    svc, ingest, ctx = learner
    real = dealer(ctx, svc.port)
    assert hello(real, "a0").type == "welcome"
    assert rpc(real, TransitionBatch.from_records("a0", 0, records(4)).to_frames())["acked_seq"] == 3
    impostor = dealer(ctx, svc.port)
    r = hello(impostor, "a0", resend_from=10**12)
    assert r.type == "error" and r["code"] == "actor_id_in_use"
    assert ingest.received["a0"] == 3
    r = rpc(impostor, TransitionBatch.from_records("a0", 4, records(2, start=4)).to_frames())
    assert r["code"] == "handshake_required"
    # the real actor's next records still arrive and are acknowledged
    r = rpc(real, TransitionBatch.from_records("a0", 4, records(3, start=4)).to_frames())
    assert r.type == "ack" and r["acked_seq"] == 6 and r["received_seq"] == 6
    assert ingest.sink.total_added == 7


def test_the_same_actor_process_retrying_its_hello_takes_over_its_own_session(learner):
    """Hellos queued while the learner started: the first one admitted came from a socket the
    actor has since closed; its retry (same instance token, new socket) is let in at once."""
    svc, ingest, ctx = learner
    first = dealer(ctx, svc.port)
    assert hello(first, "a0", instance="tok-1").type == "welcome"
    retry = dealer(ctx, svc.port)
    assert hello(retry, "a0", instance="tok-1").type == "welcome"
    r = rpc(retry, TransitionBatch.from_records("a0", 0, records(3)).to_frames())
    assert r.type == "ack" and r["acked_seq"] == 2
    other = dealer(ctx, svc.port)  # another process (another token, or none) is still refused
    assert hello(other, "a0", instance="tok-2")["code"] == "actor_id_in_use"
    assert hello(dealer(ctx, svc.port), "a0")["code"] == "actor_id_in_use"


def test_a_silent_session_frees_its_id_and_the_client_retries_meanwhile(ports, tmp_path):
    svc, ingest, ctx, close = make_service(ports, peer_timeout_s=1.5)
    try:
        old = dealer(ctx, svc.port)
        assert hello(old, "a0").type == "welcome"
        client = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0",
                               config_hash=HASH, spool=Spool(tmp_path / "spool"), timeout_s=0.3)
        t0 = time.monotonic()
        client.connect(give_up_after_s=10)  # refused while "old" is live, then admitted
        assert client.connected and time.monotonic() - t0 >= 1.0
        assert svc.rejections["actor_id_in_use"] >= 1
        # its own retried handshake (new socket, same process) is let in at once
        token, refused = client.instance, svc.rejections["actor_id_in_use"]
        t0 = time.monotonic()
        client.reconnect()
        assert client.connected and client.instance == token
        assert svc.rejections["actor_id_in_use"] == refused and time.monotonic() - t0 < 1.0
        client.close()
    finally:
        close()


def test_a_resend_position_never_acknowledged_is_refused_with_durable_acks(ports, tmp_path):
    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False).start()
    ingest = Ingest(ReplayBuffer(100, SPEC), store=store)
    svc, _, ctx, close = make_service(ports, ingest=ingest)
    try:
        s = dealer(ctx, svc.port)
        r = hello(s, "a0", resend_from=500)
        assert r.type == "error" and r["code"] == "bad_resend" and "500" in r["message"]
        assert ingest.received.get("a0", -1) == -1
        assert hello(s, "a0", resend_from=0).type == "welcome"
    finally:
        close()
        store.close()


def test_an_actor_id_is_bound_to_its_curve_key(ports, tmp_path):
    keys = make_keys(tmp_path / "keys", ["learner", "arm-1", "arm-2"])
    security = {"server_secret_key": str(keys["learner"][1]),
                "authorized_keys_dir": str(tmp_path / "keys" / "actors")}
    svc, ingest, ctx, close = make_service(ports, security=security)

    def client_sec(name):
        return {"client_secret_key": str(keys[name][1]), "server_public_key": str(keys["learner"][0])}
    try:
        arm2 = dealer(ctx, svc.port, client_sec("arm-2"))
        r = hello(arm2, "arm-1")
        assert r.type == "error" and r["code"] == "identity_mismatch" and "arm-2" in r["message"]
        arm1 = dealer(ctx, svc.port, client_sec("arm-1"))
        assert hello(arm1, "arm-1").type == "welcome"
        assert rpc(arm1, TransitionBatch.from_records("arm-1", 0, records(2)).to_frames())["acked_seq"] == 1
        # the key's holder may take its id over from its own stale session (a reconnect)
        arm1b = dealer(ctx, svc.port, client_sec("arm-1"))
        assert hello(arm1b, "arm-1", resend_from=2).type == "welcome"
        r = rpc(arm1b, TransitionBatch.from_records("arm-1", 2, records(2, start=2)).to_frames())
        assert r["acked_seq"] == 3 and ingest.sink.total_added == 4
    finally:
        close()


def test_one_key_filed_under_two_ids_is_refused(tmp_path):
    import shutil

    from data.core.security import authorized_actor_ids

    keys = make_keys(tmp_path / "keys", ["learner", "arm-1"])
    actors = tmp_path / "keys" / "actors"
    assert authorized_actor_ids(actors) == {next(iter(authorized_actor_ids(actors))): "arm-1"}
    shutil.copy(keys["arm-1"][0], actors / "arm-9.key")
    with pytest.raises(ValueError, match="one key, one id"):
        authorized_actor_ids(actors)


def test_a_flood_of_hellos_under_many_ids_keeps_the_session_table_bounded(ports):
    svc, _, ctx, close = make_service(ports, peer_timeout_s=0.3)
    try:
        most = 0
        for wave in range(3):
            socks = [dealer(ctx, svc.port) for _ in range(300)]  # 300 sessions, 300 ids
            for i, s in enumerate(socks):
                s.send_multipart(encode("hello", {"actor_id": f"w{wave}-{i}", "config_hash": HASH,
                                                  "resend_from": 0}))
            for s in socks:
                assert s.poll(5000)
                assert decode(s.recv_multipart()).type == "welcome"
                s.close(0)
            most = max(most, len(svc.peers))
            time.sleep(0.4)  # the wave goes silent
        # 900 sessions came; the silent ones are forgotten once more than 256 are held
        assert 0 < most <= 300 + 257 and len(svc.peers) <= 300 + 257
        served(svc, ctx)
    finally:
        close()


def test_without_a_store_a_resend_position_this_process_never_acknowledged_is_refused(ports):
    """No episode store: an actor this process has acknowledged cannot be moved ahead by a hello
    (its records would be skipped as lost); an actor it never heard of still may resume ahead
    (what an earlier learner process acknowledged is unknown)."""
    ingest = Ingest(ReplayBuffer(100, SPEC))
    svc, _, ctx, close = make_service(ports, ingest=ingest, peer_timeout_s=0.3)
    try:
        s = dealer(ctx, svc.port)
        assert hello(s, "a0").type == "welcome"
        r = rpc(s, TransitionBatch.from_records("a0", 0, records(3)).to_frames())
        assert r.type == "ack" and r["received_seq"] == 2
        s.close(0)
        time.sleep(0.5)  # the session is stale: the id is free again
        s = dealer(ctx, svc.port)
        r = hello(s, "a0", resend_from=500)
        assert r.type == "error" and r["code"] == "bad_resend" and "500" in r["message"]
        assert ingest.received["a0"] == 2 and ingest.acked["a0"] == 2
        assert hello(s, "a0", resend_from=3).type == "welcome"
        s2 = dealer(ctx, svc.port)
        assert hello(s2, "fresh", resend_from=500).type == "welcome"
        assert ingest.received["fresh"] == 499
    finally:
        close()
