"""Ingest in front of the ring and the LeRobot episode store: durable acks, bad input."""

import logging
import threading
import time

import numpy as np
import pytest

from data.store import EpisodeStore, read_episodes
from data.replay import ReplayBuffer
from data.core.transitions import TransitionError
from learner.ingest import EpisodeStats, Ingest
from test_buffer_helpers import SPEC, batch, episode_batch, episode_records


class Acks:
    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.event = threading.Event()

    def __call__(self, actor, seq):
        self.log.append((actor, seq))
        self.event.set()


@pytest.fixture
def learner(tmp_path):
    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False).start()
    acks = Acks()
    ingest = Ingest(ReplayBuffer(500, SPEC), store=store, on_ack=acks)
    yield ingest, store, acks
    store.close()


def service_receive(ingest, b):
    """What learner/service.py does with a transitions message."""
    try:
        b.validate(SPEC)
    except TransitionError as exc:
        ingest.count_rejection(str(exc))
        return ingest.skip(b)
    return ingest.add(b)[0]


def test_acks_wait_until_the_episode_is_durable(learner):
    ingest, store, acks = learner
    recs = episode_records(0, 9)  # 10 records
    assert service_receive(ingest, batch("a0", 0, recs[:4])) == -1
    assert service_receive(ingest, batch("a0", 4, recs[4:8])) == -1
    assert ingest.sink.total_added == 8 and len(ingest.sink) == 7  # sampleable already
    service_receive(ingest, batch("a0", 8, recs[8:]))
    assert store.flush(60)
    assert acks.event.wait(5) and acks.log[-1] == ("a0", 9)
    assert ingest.acked["a0"] == 9 and store.total_episodes == 1
    # an episode in progress holds the ack back; the dataset holds whole episodes only
    service_receive(ingest, batch("a0", 10, episode_records(1, 5)[:3]))
    assert ingest.acked["a0"] == 9 and ingest.received["a0"] == 12
    assert store.flush(30) and store.total_episodes == 1
    # the commit record carries the acks: a restarted learner starts from them
    store2 = EpisodeStore(store.root, SPEC, video=False)
    ingest2 = Ingest(ReplayBuffer(500, SPEC), store=store2)
    store2.load_into(ingest2.sink)
    assert ingest2.actor_position("a0") == (9, 1)
    assert ingest2.sink.restored == 10 and ingest2.sink.total_added == 0
    ingest2.load_state_dict({"acked": {"a0": 3}, "received": {"a0": 12}, "steps": 5})
    assert ingest2.acked["a0"] == 9 and ingest2.received["a0"] == 9  # never lowered, 10.. resent


BAD = {
    "nan": lambda r: r[1].__setitem__("reward", np.float32("nan")),
    "inf_state": lambda r: r[2]["observation.state"].__setitem__(0, np.inf),
    "image_shape": lambda r: r[1].__setitem__("observation.images.front", np.zeros((8, 32, 3), np.uint8)),
    "dtype": lambda r: r[1].__setitem__("observation.state", np.zeros(3, np.float64)),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_malformed_records_are_rejected_and_nothing_stored_changes(learner, what, caplog):
    ingest, store, _ = learner
    service_receive(ingest, episode_batch("a0", 0, 0, 4))
    assert store.flush(60) and store.total_episodes == 1
    before = (ingest.sink.total_added, len(ingest.sink), store.total_frames)
    recs = episode_records(1, 4)
    BAD[what](recs)
    if what in ("image_shape", "dtype"):
        with pytest.raises(ValueError):  # np.stack refuses, or validate below
            b = batch("a0", 5, recs)
            b.validate(SPEC)
        recs = episode_records(1, 4)
        b = batch("a0", 5, recs)
        key = "observation.images.front" if what == "image_shape" else "observation.state"
        b.arrays[key] = (b.arrays[key][:, :8] if what == "image_shape"
                         else b.arrays[key].astype(np.float64))
    else:
        b = batch("a0", 5, recs)
    acked = service_receive(ingest, b)
    assert acked == 9  # consumed: the actor's stream goes on
    assert sum(ingest.rejections.values()) == 1
    assert (ingest.sink.total_added, len(ingest.sink), store.total_frames) == before
    assert store.flush(30) and store.total_episodes == 1


def test_steps_after_an_episode_end_are_rejected(learner, caplog):
    ingest, store, _ = learner
    caplog.set_level(logging.WARNING, "tandem.learner.ingest")
    service_receive(ingest, episode_batch("a0", 0, 0, 4))  # seq 0..4
    assert store.flush(60)
    before = (ingest.sink.total_added, store.total_frames)
    # another step of episode 0 after its final record
    late = episode_records(0, 6)[5:6]
    assert service_receive(ingest, batch("a0", 5, late)) == 5
    assert ingest.rejections["after_episode_end"] == 1
    # a step after a terminating step that is not the final record
    recs = episode_records(1, 3, terminated=True)  # steps 0, 1, 2 (terminal), 3 (is_last)
    recs[3] = {**recs[2], "step": 3, "terminated": False, "truncated": False}  # not is_last
    assert service_receive(ingest, batch("a0", 6, recs)) == 9
    assert ingest.rejections["after_episode_end"] == 2
    # steps that skip, and a final record after a step that did not end the episode
    recs = episode_records(2, 5)
    del recs[2]
    service_receive(ingest, batch("a0", 10, recs))
    assert ingest.rejections["step_gap"] == 1
    recs = episode_records(3, 5)
    recs[4] = {**recs[5], "step": 4}
    service_receive(ingest, batch("a0", 15, recs[:5]))
    assert ingest.rejections["is_last_without_end"] == 1
    assert (ingest.sink.total_added, store.total_frames) == before
    assert store.flush(30) and store.total_episodes == 1
    assert "after_episode_end" in caplog.text and "step_gap" in caplog.text


def test_an_episode_that_loses_records_is_dropped_never_half_written(learner):
    ingest, store, acks = learner
    recs = episode_records(0, 12)  # 13 records
    service_receive(ingest, batch("a0", 0, recs[:5]))
    bad = batch("a0", 5, recs[5:9])
    bad.arrays["reward"][1] = np.nan
    service_receive(ingest, bad)  # rejected: episode 0 lost steps 5..8
    assert ingest.dropped_episodes["lost_records"] == 1
    assert ingest.acked["a0"] == 8  # nothing of episode 0 will ever be stored: settled
    service_receive(ingest, batch("a0", 9, recs[9:]))  # the rest is discarded
    assert ingest.episodes.discarded_records == 4
    service_receive(ingest, episode_batch("a0", 13, 1, 3))
    assert store.flush(60)
    assert [e.columns["actor_episode"][0] for e in read_episodes(store.root)] == [1]
    assert ingest.acked["a0"] == 16


def test_an_unfinished_episode_is_dropped_when_the_actor_moves_on(learner):
    ingest, store, _ = learner
    service_receive(ingest, batch("a0", 0, episode_records(0, 8)[:4]))  # actor restarted here
    assert ingest.acked.get("a0", -1) == -1
    service_receive(ingest, episode_batch("a0", 4, 1, 3))
    assert store.flush(60)
    assert ingest.dropped_episodes["unfinished"] == 1
    assert ingest.acked["a0"] == 7 and store.total_episodes == 1
    # an episode whose start is missing is dropped too
    service_receive(ingest, batch("a0", 8, episode_records(2, 6)[3:]))
    assert ingest.dropped_episodes["start_missing"] == 1 and ingest.acked["a0"] == 11


def test_an_episode_without_end_cannot_hold_the_ack_forever(tmp_path):
    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False).start()
    ingest = Ingest(ReplayBuffer(500, SPEC), store=store, max_episode_records=10)
    try:
        recs = episode_records(0, 30, final=False)
        for i in range(0, 30, 6):
            service_receive(ingest, batch("a0", i, recs[i:i + 6]))
        assert ingest.dropped_episodes["too_long"] == 1
        assert ingest.acked["a0"] == 29 and ingest.episodes.discarded_records == 18
    finally:
        store.close()

def test_episode_stats_can_be_read_while_another_thread_adds():
    """The socket thread adds episodes while the main loop reads the summary."""
    stats = EpisodeStats(window=300_000)
    for i in range(300_000):  # long deques: one read spans several thread switches
        stats.add("task 0", float(i), i % 2 == 0, 10)
    stop = threading.Event()
    errors = []

    def writer():
        i = 0
        while not stop.is_set():
            stats.add("task 0", float(i), i % 2 == 0, 10)
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            try:
                stats.summary()
                stats.per_task()
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        t.join(5)
    assert not errors, errors
    assert stats.summary()["episodes"] == stats.episodes > 1000
