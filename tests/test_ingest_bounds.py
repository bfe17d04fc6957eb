"""Global memory bounds (issue 24, class 4): unfinished episodes of all actors together hold
at most ``max_staged_bytes`` of staged records. 40 actor ids each streaming a never-ending
episode leave the learner's retained memory bounded (the oldest unfinished episodes are
evicted, counted), and an ordinary actor's finished episodes are still stored and
acknowledged: nothing acknowledged is lost. A real Ingest, replay ring and LeRobot episode store."""

import gc
import tracemalloc

from data.replay import ReplayBuffer
from data.store import EpisodeStore, read_episodes
from learner.ingest import Ingest
from test_buffer_helpers import SPEC, batch, episode_batch, episode_records

BUDGET = 4 << 20


def test_never_ending_episodes_of_many_ids_stay_within_the_staged_budget(tmp_path):
    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False).start()
    try:
        ingest = Ingest(ReplayBuffer(64, SPEC), store=store, max_staged_bytes=BUDGET)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        seq = {f"x{i}": 0 for i in range(40)}
        honest_seq, honest_eps = 0, 0
        for rnd in range(12):  # each id: 12 batches of 32 records of one episode that never ends
            for actor in seq:
                recs = episode_records(0, 32 * (rnd + 1), final=False)[32 * rnd:]
                recs[-1]["truncated"] = False  # it never ends
                ingest.add(batch(actor, seq[actor], recs))
                seq[actor] += len(recs)
            if rnd % 3 == 0:  # meanwhile an ordinary actor finishes short episodes
                b = episode_batch("honest", honest_seq, honest_eps, 10)
                ingest.add(b)
                honest_seq, honest_eps = honest_seq + len(b), honest_eps + 1
            del recs
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        one_record = 2 * 32 * 32 * 3 + 64
        streamed = 40 * 12 * 32 * one_record  # ~9.8 MB of never-ending episodes
        # what stays: the staged budget, the replay ring (64 records), the store's queue
        assert retained < BUDGET + (3 << 20), (retained, streamed)
        assert ingest.episodes.staged_bytes <= BUDGET
        assert ingest.dropped_episodes["evicted"] >= 20
        assert store.flush(60)
        # the ordinary actor: every episode durable and acknowledged, in the dataset once
        assert ingest.acked["honest"] == honest_seq - 1
        stored = [int(e.columns["actor_episode"][0]) for e in read_episodes(store.root)
                  if str(e.columns["actor_id"][0]) == "honest"]
        assert stored == list(range(honest_eps))
        # an evicted id's records were never acknowledged before; its ack moved past them
        assert all(ingest.acked.get(a, -1) <= seq[a] - 1 for a in seq)
    finally:
        store.close()


def test_episode_statistics_keep_a_bounded_number_of_tasks():
    from learner.episode_stats import MAX_TASKS, OTHER_TASKS, EpisodeStats

    stats = EpisodeStats(window=5)
    for i in range(MAX_TASKS + 500):  # every episode with an instruction of its own
        stats.add(f"task {i}", 1.0, True, 3)
    assert len(stats.returns) == MAX_TASKS + 1 and len(stats.returns[OTHER_TASKS]) == 5
    assert stats.summary()["episodes"] == MAX_TASKS + 500


def test_the_number_of_actor_ids_the_learner_keeps_state_for_is_bounded(ports):
    """Every actor id's sequence state is kept for good: hellos naming new ids are refused past
    ``max_actor_ids`` (too_many_actors); known ids still handshake."""
    from data.core.transitions import TransitionBatch
    from test_wire_hardening import dealer, hello, make_service, records, rpc

    svc, ingest, ctx, close = make_service(ports, max_actor_ids=3)
    try:
        for a in ("a", "b", "c"):
            s = dealer(ctx, svc.port)
            assert hello(s, a).type == "welcome"
            assert rpc(s, TransitionBatch.from_records(a, 0, records(2)).to_frames()).type == "ack"
            s.close(0)
        r = hello(dealer(ctx, svc.port), "d")
        assert r.type == "error" and r["code"] == "too_many_actors" and "3" in r["message"]
        assert ingest.actor_count() == 3
        svc.peers.clear()  # (the sessions above are gone, as after peer_timeout_s)
        assert hello(dealer(ctx, svc.port), "b").type == "welcome"  # a known id
    finally:
        close()
