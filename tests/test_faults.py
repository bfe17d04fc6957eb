"""Fault injection with real processes on loopback: SIGKILL of the learner mid-checkpoint
and mid-weight-publish, a network partition and a delaying, jittering, lossy link
(tools/bench/netproxy.py: this machine has no ``sch_netem`` for ``tc netem``), a stalled actor
receiving weights, NaN / Inf records. Each test counts what the actors produced (their
spools' sequence numbers) against what the LeRobot dataset holds (``actor_id``, ``actor_seq``
columns): nothing lost, nothing twice.

The checkpoint, partition and mid-publish-kill runs take 1.5 to 3.5 min each on 2 cores, past
the suite's budget: they run with ``TANDEM_FAULT_TESTS=1 uv run --frozen pytest -q
tests/test_faults.py``. The NaN / Inf test and the stalled-actor run always run; the
mid-publish kill's parts also run fast in tests/test_weights.py (a truncated, corrupted or
partial snapshot refused; a restarted learner's weights taken, the dead one's broadcasts not).
"""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

from tandem_testutil import free_port
from test_integration import Run

pytestmark = pytest.mark.slow
process_faults = pytest.mark.skipif(
    not os.environ.get("TANDEM_FAULT_TESTS"),
    reason="long fault-injection runs: TANDEM_FAULT_TESTS=1 uv run --frozen pytest -q tests/test_faults.py")

# the learner checkpoints and publishes after every update: a kill lands in one or the other
BUSY = ["trainer.checkpoint_every=1", "algo.publish_every=1", "buffer.video=false",
        "buffer.commit_interval_s=0.3"]


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop_all()


def _start_actor(run: Run, actor_id: str, port: int, pub: int, *over):
    import sys

    return run._start([sys.executable, "-m", "actor", "env=reacher", f"run_dir={run.dir}",
                       f"transport.port={port}", f"transport.pub_port={pub}",
                       "transport.timeout_s=1.0", "transport.heartbeat_s=0.5",
                       f"actor_id={actor_id}", "spool.fsync=false", "log_every_s=1", *over],
                      f"{actor_id}.log")


def dataset_rows(run: Run):
    import pandas as pd

    files = sorted((run.dir / "dataset").rglob("data/**/*.parquet"))
    assert files, "no dataset"
    return pd.concat(pd.read_parquet(f, columns=["actor_id", "actor_seq", "policy_version"])
                     for f in files)


def assert_exactly_once(run: Run, actors: list[str]) -> dict[str, int]:
    """Every record each actor produced is in the dataset once; returns the counts."""
    df = dataset_rows(run)
    counts = {}
    for a in actors:
        produced = run.spool_meta(a)["next_seq"]
        seqs = np.sort(df.loc[df.actor_id == a, "actor_seq"].to_numpy())
        dup = int((np.diff(seqs) == 0).sum())
        missing = sorted(set(range(produced)) - set(seqs.tolist()))
        assert dup == 0, f"{a}: {dup} records stored twice"
        assert not missing, f"{a}: {len(missing)} of {produced} records missing, first {missing[:5]}"
        assert len(seqs) == produced
        counts[a] = produced
    return counts


def finish(run: Run, learner, actors: dict[str, object], timeout=240):
    """Actors run to their max_episodes and drain; then the learner stops cleanly."""
    for name, p in actors.items():
        run.wait(lambda p=p: p.poll() is not None, timeout, f"{name} to finish")
        assert p.returncode == 0, p.log.read_text()[-3000:]
    final = {a: run.spool_meta(a)["next_seq"] for a in actors}
    run.wait(lambda: all(run.status().get("received", {}).get(a) == n - 1 for a, n in final.items()),
             60, "every record received")
    # and durable: a learner stopped with episodes still queued for the store leaves them to
    # the actors' spools (bounded shutdown), which these checks would count as missing
    run.wait(lambda: run.status().get("store_lag_records", 1) == 0, 120, "every record durable")
    learner.send_signal(signal.SIGTERM)  # (SIGINT is ignored when pytest runs in the background)
    learner.wait(120)  # a final checkpoint and dataset commit


@process_faults
def test_learner_sigkill_mid_checkpoint_write_resumes_from_the_last_complete_one(run):
    ckpts = run.dir / "checkpoints"
    first = run.learner(*BUSY)
    actors = {"a0": run.actor("a0", "mode=local", "max_episodes=8", "spool.batch_size=8",
                            "drain_s=240"),  # outlasts the restart: delivers its backlog
              "a1": run.actor("a1", "max_episodes=8", "seed=100", "spool.batch_size=8")}
    run.wait(lambda: (ckpts / "latest").exists() and run.status().get("updates", 0) > 5, 240,
             "checkpoints")
    # hit a write in progress: a temporary checkpoint folder exists only while one is written
    deadline, hit = time.monotonic() + 60, None
    while hit is None and time.monotonic() < deadline:
        hit = next((e.name for e in os.scandir(ckpts) if e.name.startswith(".tmp_")), None)
        if hit:
            first.send_signal(signal.SIGKILL)
    assert hit, "never saw a checkpoint being written"
    first.wait()
    complete = (ckpts / "latest").read_text().strip()
    left = [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp_")]
    assert left, "the kill missed the write (it finished first)"
    from learner.checkpoint import latest_checkpoint, load_checkpoint

    assert latest_checkpoint(ckpts).name == complete  # the half-written one is not "latest"
    assert load_checkpoint(ckpts / complete)["algo"]  # the last complete one loads whole
    step = int(complete.split("_")[1])
    second = run.learner(*BUSY, log="learner-restart.log")
    run.wait(lambda: "resumed from" in second.log.read_text(), 240, "resume")
    resumed = re.search(r"resumed from (\S+)", second.log.read_text()).group(1)
    assert resumed.endswith(complete), (resumed, complete, left)
    finish(run, second, actors)
    counts = assert_exactly_once(run, ["a0", "a1"])
    assert counts == {"a0": 8 * 51, "a1": 8 * 51}
    st = run.status()
    assert st["updates"] > step and not any(st["dropped_episodes"].values()), st
    print(f"killed mid-write of {left}, resumed from {complete}; records {counts}")


PARTITION_S = float(os.environ.get("TANDEM_PARTITION_S", "30"))


@process_faults
def test_partition_then_heal_drains_the_backlog_and_a_lossy_link_keeps_versions_in_order(run):
    from tools.bench.netproxy import NetProxy

    port, pub = free_port(), free_port()
    learner = run.learner("buffer.video=false", "buffer.commit_interval_s=0.3")
    link = NetProxy(port, run.port)
    link_pub = NetProxy(pub, run.pub)
    try:
        actors = {"a0": _start_actor(run, "a0", port, pub, "max_episodes=40", "spool.batch_size=8"),
                  "a1": _start_actor(run, "a1", port, pub, "mode=local", "max_episodes=40",
                                     "seed=100", "spool.batch_size=8")}
        run.wait(lambda: all(run.status().get("received", {}).get(a, -1) > 60 for a in actors), 240,
                 "records through the proxy")
        # partition: nothing crosses for PARTITION_S (30 s, the figure)
        link.partition()
        link_pub.partition()
        time.sleep(1.5)  # status.json is rewritten every 0.5 s: let it catch up first
        before = dict(run.status()["received"])
        time.sleep(PARTITION_S)
        spooled = run.spool_meta("a1")["next_seq"] - 1
        during = dict(run.status()["received"])
        assert during == before, "records crossed a partitioned link"
        if actors["a1"].poll() is None:  # (it may have run all its episodes already)
            assert spooled > before["a1"] + 20, "the local actor stopped stepping in the partition"
        link.heal()
        link_pub.heal()
        run.wait(lambda: run.status()["received"]["a1"] >= spooled, 60, "the backlog to drain")
        # a bad link: 40 +- 30 ms delay, 5 % "loss" (a 200 ms retransmit each)
        for p in (link, link_pub):
            p.set_link(delay_ms=40, jitter_ms=30, loss=0.05)
        r0 = dict(run.status()["received"])
        time.sleep(8)
        # the remote actor needs the link for every chunk (the local one may be done by now;
        # the remote one runs 40 episodes, more than fit before this point)
        assert actors["a0"].poll() is None, "the remote actor finished before the lossy link"
        assert run.status()["received"]["a0"] > r0["a0"], "no progress on a lossy link"
        assert link.counters["lost_chunks"] > 0
        for p in (link, link_pub):
            p.set_link(delay_ms=0, jitter_ms=0, loss=0)
        finish(run, learner, actors)
    finally:
        link.close()
        link_pub.close()
    counts = assert_exactly_once(run, ["a0", "a1"])
    df = dataset_rows(run).sort_values(["actor_id", "actor_seq"])
    for a in counts:  # actions come from replies that answer the request: versions never go back
        v = df.loc[df.actor_id == a, "policy_version"].to_numpy()
        assert (np.diff(v) >= 0).all(), f"{a}: policy version went back"
    assert not any(run.status()["dropped_episodes"].values())
    print(f"partition + lossy link: records {counts}, proxy {link.counters}")


# a learner that trains without pause and publishes every update, with ~0.3 MB snapshots
# (policy 256x256: the actors must say the same), checkpointing often
PUBLISHING = ["algo.publish_every=1", "algo.max_update_ratio=0", "trainer.checkpoint_every=40",
              "buffer.video=false", "buffer.commit_interval_s=0.3", "policy.hidden_dims=[256,256]"]
ACTOR_POLICY = "policy.hidden_dims=[256,256]"


def loaded_versions(log_text: str) -> list[int]:
    """The policy versions a local actor loaded, in order (its log)."""
    return [int(v) for v in re.findall(r"loaded policy version (\d+)", log_text)]


# ~8.4 MB snapshots: larger than the kernel's TCP buffers (4 MB), so a sender killed while
# the link is saturated always dies with part of a snapshot still unsent (a 0.3 MB one fits
# whole in the kernel's send buffer, which still delivers it after the kill)
BIG = "policy.hidden_dims=[1448,1448]"


@process_faults
def test_learner_sigkill_mid_weight_publish_never_loads_a_partial_snapshot(run):
    """The weight link is thin (4 MB/s through tools/bench/netproxy.py) and the learner publishes an
    8.4 MB snapshot after every update, so a snapshot is always on the wire; SIGKILL lands
    while one is part way out (the proxy follows the ZMTP framing: the learner's stream ends
    inside a message). The actor loads no partial or corrupt snapshot (every load verified:
    nothing refused), takes the restarted learner's complete snapshot (never a broadcast of
    the dead one after it), and every record arrives exactly once. The actor is held
    (SIGSTOP) while the learner restarts, so that it is still stepping when it comes back."""
    from tools.bench.netproxy import NetProxy

    pub = free_port()
    learner_args = [*PUBLISHING[:-1], BIG, "trainer.checkpoint_every=30"]
    first = run.learner(*learner_args)
    link = NetProxy(pub, run.pub, rate_kbps=4000)
    try:
        actor = _start_actor(run, "a0", run.port, pub, "mode=local", BIG, "max_episodes=40",
                             "spool.batch_size=8", "drain_s=120")
        run.wait(lambda: len(loaded_versions(actor.log.read_text())) >= 2
                 and (run.dir / "checkpoints" / "latest").exists(), 180, "broadcast weights loaded")
        run.wait(link.mid_message, 30, "a snapshot part way through the link")
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = run.learner(*learner_args, log="learner-restart.log")
        # what the dead learner's kernel still held drains; then its stream ends, inside a snapshot
        run.wait(lambda: link.counters["cut_messages"] >= 1, 60, f"the cut ({link.counters})")
        cut = dict(link.counters)
        actor.send_signal(signal.SIGSTOP)
        try:
            run.wait(lambda: "resumed from" in second.log.read_text(), 180, "resume")
        finally:
            actor.send_signal(signal.SIGCONT)
        resumed_v = int(re.search(r"policy version (\d+)", second.log.read_text().split("resumed from")[1]).group(1))
        run.wait(lambda: "learner restarted" in actor.log.read_text()
                 and loaded_versions(actor.log.read_text().split("learner restarted")[-1]), 120,
                 "the actor to load the restarted learner's weights")
        finish(run, second, {"a0": actor})
    finally:
        link.close()
    text = actor.log.read_text()
    assert "refused weights" not in text and "bad weights broadcast" not in text, text[-3000:]
    old, new = text.split("learner restarted")
    after = loaded_versions(new)
    # the restarted learner's weights (from its checkpoint's version on), in order, none of the
    # dead learner's broadcasts after them
    assert after[0] >= resumed_v and after == sorted(set(after)), (after, resumed_v)
    assert loaded_versions(old) == sorted(set(loaded_versions(old)))
    counts = assert_exactly_once(run, ["a0"])
    assert counts == {"a0": 40 * 51}
    print(f"killed with a snapshot part way out ({cut['cut_bytes'] / 1e6:.1f} of 8.4 MB sent, "
          f"{cut['messages']} whole ones before it); the actor loaded {len(loaded_versions(old))} + "
          f"{len(after)} versions (broadcast or fetched; restart resumed at {resumed_v}), none "
          f"refused; records {counts}")


def test_a_stalled_actor_gets_the_latest_weights_only_and_its_versions_never_go_back(run):
    """A local actor is stopped (SIGSTOP) for 4 s while the learner publishes a version per
    update; after SIGCONT it loads the newest (the learner's current, fetched when the queued
    broadcasts are older than what the learner reports), not the backlog; the versions it
    loaded, and those its records carry, never go down."""
    learner = run.learner(*PUBLISHING)
    # enough episodes that the actor is still acting (and taking weights) when it is stopped
    # and resumed; with 8 it could finish all of them first on a quiet machine
    actor = _start_actor(run, "a0", run.port, run.pub, "mode=local", ACTOR_POLICY, "max_episodes=60",
                         "spool.batch_size=8")
    run.wait(lambda: len(loaded_versions(actor.log.read_text())) >= 3, 180, "broadcast weights loaded")
    assert actor.poll() is None and run.status().get("episodes", 0) < 40, "the actor finished too soon"
    actor.send_signal(signal.SIGSTOP)
    try:
        held = len(actor.log.read_text())
        time.sleep(1.0)  # status.json is rewritten every 0.5 s
        v_stop = run.status()["version"]
        time.sleep(3.0)
        v_resume = run.status()["version"]
    finally:
        actor.send_signal(signal.SIGCONT)
    assert v_resume - v_stop >= 5, (v_stop, v_resume)  # the learner published on
    run.wait(lambda: any(v >= v_resume for v in loaded_versions(actor.log.read_text()[held:])), 60,
             "the actor to catch up")
    before, after = loaded_versions(actor.log.read_text()[:held]), loaded_versions(actor.log.read_text()[held:])
    caught = next(i for i, v in enumerate(after) if v >= v_resume)
    # on the way, only broadcasts queued before the stop (an actor lagging behind the learner can
    # hold a couple), then a jump to the learner's version: none published during the stall loaded
    assert all(v < v_stop for v in after[:caught]), \
        f"stepped through the stall's backlog: {after[:caught + 1]} (stopped at {v_stop}, resumed at {v_resume})"
    jump = after[caught] - ([before[-1], *after][caught])
    assert jump >= v_resume - v_stop, f"it skipped only {jump - 1} versions: {before[-1:]} + {after[:caught + 1]}"
    finish(run, learner, {"a0": actor})
    versions = loaded_versions(actor.log.read_text())
    assert all(b > a for a, b in zip(versions, versions[1:])), versions  # never back, never twice
    counts = assert_exactly_once(run, ["a0"])
    df = dataset_rows(run).sort_values("actor_seq")
    v = df.loc[df.actor_id == "a0", "policy_version"].to_numpy()
    assert (np.diff(v) >= 0).all(), "a record's policy version went back"
    print(f"stalled at version {before[-1]} while the learner went {v_stop} -> {v_resume}; "
          f"then loaded {after[:caught + 1]}; {len(versions)} loads in all; records {counts}")


def _episode_records(episode: int, n: int, *, bad: str | None = None):
    """An episode of ``n`` steps + its final record; ``bad`` puts NaN / Inf in one step."""
    from test_wire_hardening import records

    recs = records(n, episode=episode)
    recs[-1]["truncated"] = True
    recs.append({**records(1, episode=episode, start=n)[0], "is_last": True})
    if bad == "nan_obs":
        recs[n // 2]["observation.state"] = np.array([0, np.nan, 0, 0], np.float32)
    elif bad == "inf_reward":
        recs[n // 2]["reward"] = np.inf
    return recs


def test_nan_or_inf_records_are_quarantined_counted_and_never_trained_on(tmp_path, ports):
    """A real client streams episodes through a real service into a real store; episodes 1, 4,
    7, 10 carry one NaN observation or one Inf reward (alternately). Those batches are refused and
    counted, their episodes never reach the replay buffer's samples or the dataset, and every
    clean episode arrives exactly once."""
    import zmq

    from actor.client import LearnerClient
    from actor.spool import Spool
    from data.replay import ReplayBuffer
    from data.store import EpisodeStore, read_episodes
    from data.core.transitions import TransitionBatch
    from learner.ingest import Ingest
    from test_wire_hardening import HASH, SPEC, make_service

    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False).start()
    ingest = Ingest(ReplayBuffer(2000, SPEC), store=store)
    svc, ingest, _, close = make_service(ports, ingest=ingest)
    # as the learner does: push the ack when the store makes episodes durable
    ingest.on_ack = lambda actor, seq: [svc.reply(i, svc.ack_frames(actor, seq))
                                        for i, p in list(svc.peers.items()) if p.actor_id == actor]
    ctx = zmq.Context()
    spool = Spool(tmp_path / "spool", fsync=False)
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0",
                           config_hash=HASH, spool=spool, timeout_s=1.0)
    try:
        client.connect(give_up_after_s=30)
        n, clean, seq = 9, [], 0
        for ep in range(12):
            bad = (None if ep % 3 != 1 else "nan_obs" if ep % 2 else "inf_reward")
            recs = _episode_records(ep, n, bad=bad)
            if ep % 3 != 1:
                clean.append(ep)
            spool.append(TransitionBatch.from_records("a0", seq, recs))  # one batch per episode
            seq += len(recs)
        deadline = time.monotonic() + 60
        while len(spool) and time.monotonic() < deadline:
            client.poll(0.05)
        assert not len(spool), "the actor's spool never emptied"
        assert ingest.rejections == {"observation.state": 2, "reward": 2}, dict(ingest.rejections)
        assert svc.counters["internal_errors"] == 0
        stored = sorted(int(e.columns["actor_episode"][0]) for e in read_episodes(store.root))
        assert stored == clean  # the poisoned episodes are not in the dataset, the others once
        buf = ingest.sink
        assert buf.total_added == len(clean) * (n + 1)
        s = buf.sample(256)
        assert all(np.isfinite(np.asarray(v, np.float64)).all() for k, v in s.items()
                   if np.asarray(v).dtype.kind == "f"), "a non-finite value reached a training batch"
    finally:
        client.close()
        ctx.destroy(0)
        close()
        store.close()
