"""Weight snapshots are sealed and verified: an actor never loads a truncated, corrupted or
partial snapshot, and a stalled actor loads the newest version only, never going back.

Real codec frames, a real :class:`actor.local_policy.LocalPolicy` (its SUB socket), and for
the latest-only test a real LearnerService, WeightPublisher and LearnerClient on loopback.
The process-level faults (a learner SIGKILLed mid-publish, a SIGSTOPped actor) are in
tests/test_faults.py.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
import zmq

from actor.local_policy import LocalPolicy
from data.core.codec import CodecError, decode, encode
from data.core.weights import DIGEST_KEY, SnapshotError, from_wire, snapshot_digest, to_wire
from test_wire_hardening import HASH, SPEC

# the policy make_service's learner serves (tests/test_wire_hardening.py)
POLICY = {"name": "mlp", "hidden_dims": [16], "cnn_channels": [4], "image_embed_dim": 8}


def _frames(version, state):
    arrays, bf16 = to_wire(state)
    return encode("weights", {"policy_version": version, "bf16": bf16}, arrays)


def _msg(version, state):
    return decode([bytes(memoryview(f)) for f in _frames(version, state)])


def _other_weights(policy, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in policy.trainable_state_dict().items()}


def _params(local):
    return {k: v.clone() for k, v in local.policy.state_dict().items()}


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _service(ctx, ports):
    """A real learner service on loopback and its weight publisher (no inference needed)."""
    from data.replay import ReplayBuffer
    from learner.ingest import Ingest
    from learner.service import LearnerService
    from learner.weights import WeightPublisher

    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(100, SPEC)),
                         submit_act=lambda r: None, get_version=lambda: box["w"].version,
                         get_weights=lambda: box["w"].latest(), port=ports[0], pub_port=ports[1])
    box["w"] = WeightPublisher(lambda v, s: None, svc.publish)
    svc.start()
    return svc, box["w"]


def _skipped(log_text):
    return [int(line.split("skipped ")[1].split()[0]) for line in log_text.splitlines()
            if "loaded policy version" in line]


def test_a_snapshot_round_trips_sealed_and_its_digest_covers_names_shapes_and_bytes():
    state = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
             "lora": torch.randn(2, 2).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    msg = _msg(7, state)
    assert msg.arrays[DIGEST_KEY].dtype == np.uint8 and msg.arrays[DIGEST_KEY].shape == (16,)
    back = from_wire(msg.arrays, msg["bf16"])
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert back["lora"].dtype == torch.bfloat16
    arrays, bf16 = to_wire(state)
    d = snapshot_digest(arrays, bf16)
    for change in ({"w": arrays["w"].copy().reshape(4, 3)},            # same bytes, other shape
                   {"w2": arrays.pop("w")},                            # same tensor, other name
                   {"b": arrays["b"].astype(np.int32)}):               # same values, other dtype
        arrays, bf16 = to_wire(state)
        arrays.update(change)
        assert not np.array_equal(snapshot_digest(arrays, bf16), d), change.keys()
    arrays, bf16 = to_wire(state)
    assert not np.array_equal(snapshot_digest(arrays, []), d)  # the bf16 flag counts too
    with pytest.raises(SnapshotError, match="reserved"):
        to_wire({DIGEST_KEY: torch.zeros(16, dtype=torch.uint8)})


def test_a_corrupted_truncated_or_partial_snapshot_is_refused_and_the_loaded_weights_stay(caplog):
    ctx = zmq.Context()
    local = LocalPolicy(POLICY, SPEC, ctx=ctx, host="127.0.0.1", pub_port=1)  # SUB unused here
    try:
        good = _other_weights(local.policy, 1)
        assert local.load(_msg(2, good)) and local.version == 2
        loaded = _params(local)
        assert _same(loaded, good)
        new = _other_weights(local.policy, 2)
        frames = [bytearray(memoryview(f)) for f in _frames(5, new)]
        names = list(decode(frames).arrays)  # frame i + 1 holds names[i]
        big = 1 + max(range(len(names)), key=lambda i: len(frames[i + 1]))  # the largest tensor's frame

        def refused(msg, why):
            before = local.refused
            with caplog.at_level(logging.ERROR, logger="tandem.actor.local"):
                caplog.clear()
                assert not local.load(msg)
            assert local.refused == before + 1 and local.version == 2
            assert _same(_params(local), loaded), "a refused snapshot changed the weights"
            assert why in caplog.text, caplog.text

        # one flipped bit inside a tensor: the codec cannot tell, the digest does
        bad = [bytes(f) for f in frames]
        b = bytearray(bad[big])
        b[len(b) // 2] ^= 0x10
        bad[big] = bytes(b)
        refused(decode(bad), "digest does not match")
        # a frame cut short never gets past the codec (its length is checked against its shape)
        cut = [bytes(f) for f in frames]
        cut[big] = cut[big][: len(cut[big]) // 2]
        with pytest.raises(CodecError, match="needs"):
            decode(cut)
        # the last tensors missing (the message ends early), the digest of the whole kept
        msg = decode([bytes(f) for f in frames])
        short = dict(list(msg.arrays.items())[:2])
        short[DIGEST_KEY] = msg.arrays[DIGEST_KEY]
        refused(decode(encode("weights", {"policy_version": 5, "bf16": []}, short)), "digest does not match")
        # a partial snapshot sealed as such: its digest holds, but it is not the policy's whole state
        partial = dict(list(new.items())[:-1])
        refused(_msg(5, partial), "missing")
        # a tensor of another shape (a snapshot of another architecture), sealed
        other = dict(new)
        k0 = next(iter(other))
        other[k0] = torch.zeros(*other[k0].shape, 2)
        refused(_msg(5, other), f"tensor {k0!r}")
        # no digest at all; a bogus bf16 list
        unsealed = {k: v for k, v in msg.arrays.items() if k != DIGEST_KEY}
        refused(decode(encode("weights", {"policy_version": 5, "bf16": []}, unsealed)), "no digest")
        refused(decode(encode("weights", {"policy_version": 5, "bf16": 3}, dict(msg.arrays))), "bf16")
        # and the whole snapshot still loads afterwards
        assert local.load(decode([bytes(f) for f in frames])) and local.version == 5
        assert _same(_params(local), new) and local.refused == 6 and local.loads == 2
    finally:
        local.close()
        ctx.destroy(0)


def test_a_stalled_actor_loads_the_newest_broadcast_only_and_versions_only_go_up(tmp_path, ports, caplog):
    """A real learner service broadcasts versions 4..13 while the actor is not reading: its next
    refresh loads 13 alone (the others skipped). Then broadcasts 14..17 reach it but 18..30 are lost (as
    a PUB drops them for a subscriber that is behind) while acks/pongs tell the actor the
    learner is at 30: it skips the stale backlog and fetches 30 over the request channel."""
    from actor.client import LearnerClient
    from actor.spool import Spool

    ctx = zmq.Context()
    svc, w = _service(ctx, ports)
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0", config_hash=HASH,
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=1.0, heartbeat_s=0.1)
    local = LocalPolicy(POLICY, SPEC, ctx=ctx, host="127.0.0.1", pub_port=svc.pub_port)
    published = {}

    def publish(v):
        published[v] = _other_weights(local.policy, v)
        w.publish(published[v], version=v)

    def settle(cond, what):
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, what
            client.poll(0.02)

    try:
        publish(3)
        client.connect(give_up_after_s=10)
        local.refresh(client)  # a new learner: its weights over the request channel
        assert local.version == 3
        time.sleep(0.3)  # the SUB connection is up before the broadcasts
        caplog.set_level(logging.INFO, logger="tandem.actor.local")
        caplog.clear()
        for v in range(4, 14):
            publish(v)
        settle(lambda: client.policy_version == 13, "a pong with version 13")
        time.sleep(0.3)  # every broadcast has reached the SUB queue
        local.refresh(client)
        assert local.version == 13 and local.loads == 2, caplog.text
        # one load: the newest; the older broadcasts that reached the queue were passed over
        # (the PUB and SUB high-water marks may drop some of them on the way)
        assert "loaded policy version 13" in caplog.text and _skipped(caplog.text) >= [1], caplog.text
        assert _same(_params(local), published[13])
        for v in range(14, 18):
            publish(v)
        time.sleep(0.3)
        to_pub, w.to_pub = w.to_pub, lambda frames: None  # 18..30 never reach this subscriber
        for v in range(18, 31):
            publish(v)
        w.to_pub = to_pub
        settle(lambda: client.policy_version == 30, "a pong with version 30")
        local.refresh(client)
        assert local.version == 30 and local.loads == 3, caplog.text
        assert _skipped(caplog.text)[-1] >= 1  # (some of) 14..17 arrived, passed over, never loaded
        assert _same(_params(local), published[30])
        versions = [int(line.split("loaded policy version ")[1].split()[0])
                    for line in caplog.text.splitlines() if "loaded policy version" in line]
        assert versions == [13, 30]
        local.refresh(client)  # nothing newer: nothing loaded, nothing goes back
        assert local.version == 30 and local.loads == 3 and local.refused == 0
    finally:
        local.close()
        client.close()
        svc.stop()
        svc.join(2)
        ctx.destroy(0)


def test_after_a_learner_restart_the_actor_takes_its_weights_never_a_queued_broadcast_of_the_old_one(
        tmp_path, ports):
    """Learner A broadcasts versions 51..54 that sit in the actor's SUB queue, then dies; learner
    B on the same ports resumes from an older checkpoint (version 10, other weights). The actor
    loads B's version 10, and then never A's queued 54 (its version is higher, its weights are
    a dead run's): the subscription is renewed on a learner change. Until B's weights load, the
    actor keeps A's weights and version (its records never claim version -1 or 0)."""
    from actor.client import LearnerClient
    from actor.spool import Spool

    ctx_a, ctx_b, ctx = zmq.Context(), zmq.Context(), zmq.Context()
    svc_a, w_a = _service(ctx_a, ports)
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=ports[0], actor_id="a0", config_hash=HASH,
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=0.5, heartbeat_s=0.1)
    local = LocalPolicy(POLICY, SPEC, ctx=ctx, host="127.0.0.1", pub_port=ports[1])
    svc_b = None
    try:
        weights = {v: _other_weights(local.policy, v) for v in (10, 11, 50, 51, 52, 53, 54)}
        w_a.publish(weights[50], version=50)
        client.connect(give_up_after_s=10)
        local.refresh(client)
        assert local.version == 50 and _same(_params(local), weights[50])
        time.sleep(0.3)  # the SUB connection is up
        for v in (51, 52, 53, 54):
            w_a.publish(weights[v], version=v)
        time.sleep(0.3)  # ... and they are in the actor's queue
        svc_a.stop()
        svc_a.join(2)
        ctx_a.destroy(0)
        svc_b, w_b = _service(ctx_b, ports)
        w_b.publish(weights[10], version=10)
        deadline = time.monotonic() + 20
        while client.learner_id == svc_a.learner_id or not client.connected:
            assert time.monotonic() < deadline, "the actor never reached the restarted learner"
            client.poll(0.05)
        assert local.version == 50  # nothing loaded yet: A's weights and version stay
        local.refresh(client)
        assert local.version == 10 and _same(_params(local), weights[10])
        local.refresh(client)  # A's queued 51..54 are gone with the old subscription
        assert local.version == 10 and _same(_params(local), weights[10])
        time.sleep(0.3)
        w_b.publish(weights[11], version=11)
        deadline = time.monotonic() + 10
        while local.version != 11:
            assert time.monotonic() < deadline, "B's broadcast never loaded"
            client.poll(0.05)
            local.refresh(client)
        assert _same(_params(local), weights[11]) and local.refused == 0
    finally:
        local.close()
        client.close()
        if svc_b is not None:
            svc_b.stop()
            svc_b.join(2)
        ctx_b.destroy(0)
        ctx.destroy(0)
