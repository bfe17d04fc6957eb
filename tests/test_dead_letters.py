"""A rejected batch ends somewhere (issue 24, class 7): a batch the learner refuses, whether
its wire guard (a step out of bounds) or its episode checks (a step gap) refuse it, gets a
typed ``batch_rejected``; its records are consumed, the actor keeps the batch as a counted dead
letter and its stream goes on: the batches after it are acknowledged. A real LearnerService and
a real LearnerClient with its on-disk spool, on loopback."""

import json
import time

from actor.client import LearnerClient
from actor.spool import Spool
from data.core.transitions import TransitionBatch
from test_wire_hardening import HASH, learner, records  # noqa: F401  (fixture)


def _batch(first_seq, episode, steps):
    recs = records(len(steps), episode=episode)
    for r, s in zip(recs, steps):
        r["step"] = s
    return TransitionBatch.from_records("a0", first_seq, recs)


def test_refused_batches_become_dead_letters_and_the_stream_goes_on(learner, tmp_path):
    svc, ingest, ctx = learner
    spool = Spool(tmp_path / "spool", fsync=False)
    spool.append(_batch(0, 0, [0, 1, 2]))
    spool.append(_batch(3, 0, [3, 2**40]))      # a step out of bounds: the wire guard refuses it
    spool.append(_batch(5, 1, [0, 1, 2]))
    spool.append(_batch(8, 1, [3, 9]))          # a step gap: the episode checks refuse it
    spool.append(_batch(10, 2, [0, 1]))
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0",
                           config_hash=HASH, spool=spool, timeout_s=1.0)
    client.connect(give_up_after_s=10)
    deadline = time.monotonic() + 20
    while len(spool) and time.monotonic() < deadline:
        client.poll(0.05)
    assert len(spool) == 0, f"records still unacknowledged: {spool.pending()}"  # none resent forever
    assert spool.dead_letters == 2
    dead = sorted(p.name for p in spool.dead_dir.glob("*.msg"))
    assert dead == ["000000000003-000000000004.msg", "000000000008-000000000009.msg"]
    why = [json.loads(p.read_text()) for p in sorted(spool.dead_dir.glob("*.why.json"))]
    assert [w["code"] for w in why] == ["bad_transitions", "bad_episode"]
    assert "step" in why[0]["message"] and "step_gap" in why[1]["message"]
    assert spool.last_dead == why[1] and client.stats()["dead_letters"] == 2
    # the refused records were consumed, never stored; the rest arrived once
    assert ingest.received["a0"] == 11
    assert svc.rejections["bad_transitions"] == 1 and svc.rejections["bad_episode"] == 1
    client.close()


def test_a_dead_letter_outlives_its_recycled_spool_file_and_the_folder_is_bounded(tmp_path):
    spool = Spool(tmp_path / "spool", fsync=False)
    spool.append(_batch(0, 0, [0, 1]))
    name = "000000000000-000000000001.msg"
    blob = (spool.dir / name).read_bytes()
    assert spool.dead_letter(0, 1, "bad_transitions", "why") == 1
    assert spool.dead_letter(0, 1, "bad_transitions", "why") == 0  # once, however often refused
    spool.ack(1)  # the acknowledged file becomes a spare ...
    spool.append(_batch(2, 1, [0, 1, 2, 3]))  # ... which this append overwrites in place
    assert (spool.dead_dir / name).read_bytes() == blob  # the dead letter is a copy of its own
    assert Spool(tmp_path / "spool", fsync=False).dead_letters == 1  # counted after a restart
    small = Spool(tmp_path / "small", fsync=False, dead_max_bytes=len(blob) + 1)
    small.append(_batch(0, 0, [0, 1]))
    small.append(_batch(2, 1, [0, 1]))
    small.dead_letter(0, 3, "bad_transitions", "why")  # both batches
    # over dead_max_bytes: the oldest goes, counted and logged; the newest stays
    assert small.dead_letters == 2 and small.dead_discarded == 1
    assert [p.name for p in small.dead_dir.glob("*.msg")] == ["000000000002-000000000003.msg"]
