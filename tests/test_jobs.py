"""Learner jobs: a learner with a static job list (config ``jobs: [...]``) hands two real
actors their episodes over loopback sockets, and each job runs exactly (its reset seed and
options, its group id in every record, deterministic acts when it says so); an actor whose
``get_job`` goes unanswered runs as it likes."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq

from tandem_testutil import free_port

JOBS = [  # two groups of two episodes: same init state within a group, different seeds
    {"task_id": 0, "init_state": 1, "seed": 101, "group_id": 7},
    {"task_id": 0, "init_state": 1, "seed": 102, "group_id": 7},
    {"task_id": 0, "init_state": 2, "seed": 201, "group_id": 8, "deterministic": True},
    {"task_id": 0, "init_state": 2, "seed": 202, "group_id": 8},
]


def _jobs_override() -> str:
    def one(d):
        return "{" + ",".join(f"{k}:{str(v).lower() if isinstance(v, bool) else v}"
                              for k, v in d.items()) + "}"
    return "jobs=[" + ",".join(one(d) for d in JOBS) + "]"


@pytest.mark.slow
def test_two_actors_run_the_learners_jobs_exactly(tmp_path):
    from actor.app import Actor
    from data.core.jobs import Job
    from envs.registry import make_env
    from learner.app import Learner
    from test_extras_e2e import LearnerThread, actor_cfg, dataset_frames, learner_cfg

    run_dir = tmp_path / "run"
    port, pub = free_port(), free_port()
    learner = Learner(learner_cfg(run_dir, port, pub, _jobs_override(), "algo.learning_starts=100000"))
    assert learner.jobs is not None and learner.jobs.pending() == 4
    lt = LearnerThread(learner).start()
    # actor a runs 3 episodes, b 2: 5 requests for 4 jobs, so one episode runs without a job,
    # and each actor runs at least one job whatever the interleaving
    actors = {"a": 3, "b": 2}
    loops, errors = {}, []

    cfgs = {name: actor_cfg(run_dir, port, pub, name, f"max_episodes={n}", f"seed={500 * (name == 'b')}")
            for name, n in actors.items()}  # Hydra composes on one thread at a time

    def run(name):
        try:
            loops[name] = Actor(cfgs[name]).run()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in actors]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert learner.jobs.pending() == 0
        assigned = dict(learner.jobs.assigned)
    finally:
        lt.stop()
    assert {k: v.episodes for k, v in loops.items()} == actors
    assert sorted(v.jobs_run for v in loops.values()) in ([1, 3], [2, 2])
    assert all(v.jobs_run >= 1 for v in loops.values())
    # the learner's record of what it handed out: every job exactly once, to a (actor, episode)
    assert sorted(j.job_id for j in assigned.values()) == [0, 1, 2, 3]
    eps = dataset_frames(run_dir / "dataset")
    assert len(eps) == 5
    env_cfg = actor_cfg(run_dir, port, pub, "x").env
    env = make_env(env_cfg)
    try:
        for (actor_id, episode), c in eps.items():
            groups = set(c["group_id"].tolist())
            assert len(groups) == 1, "group_id changes within an episode"
            job = assigned.get((actor_id, episode))
            if job is None:  # the episode after the jobs ran out: as the actor likes
                assert groups == {-1}
                continue
            assert job == Job(job_id=job.job_id, **JOBS[job.job_id])  # job_id: its index
            assert groups == {job.group_id}
            # the episode started where the job says: the same reset gives the same observation
            obs, _ = env.reset(seed=job.seed, options=job.reset_options())
            np.testing.assert_array_equal(c["observation.state"][0], obs["observation.state"])
            # deterministic jobs act with the policy mean (the MLP's noise is then zeros)
            noise = c["extra.noise"][~c["is_last"].astype(bool)]
            if job.deterministic:
                assert (noise == 0).all()
            else:
                assert (np.abs(noise).reshape(len(noise), -1).sum(1) > 0).all()
    finally:
        env.close()
    assert len([k for k in eps if k in assigned]) == 4


def test_get_job_without_an_answer_runs_as_the_actor_likes(tmp_path, caplog):
    """A learner whose job source is slow: the actor's ``get_job`` gives up after
    ``timeout_s`` (logging once), and the late answer is not mistaken for the next one's."""
    from actor.client import LearnerClient
    from actor.spool import Spool
    from data.core.jobs import Job
    from data.core.spec import EnvSpec
    from data.replay import ReplayBuffer
    from learner.ingest import Ingest
    from learner.jobs import JobQueue
    from learner.service import LearnerService

    spec = EnvSpec(state_dim=3, action_dim=1)
    q = JobQueue([Job(0, seed=5, group_id=1), Job(1, seed=6, group_id=1)])
    slow = threading.Event()

    def next_job(actor_id, episode):
        if episode in (0, 1) and not slow.is_set():
            time.sleep(1.0)  # the socket thread is busy: no answer within the actor's timeout
        return q.next_job(actor_id, episode)

    ctx = zmq.Context()
    port, pub = free_port(), free_port()
    svc = LearnerService(ctx=ctx, spec=spec, config_hash="h", ingest=Ingest(ReplayBuffer(10, spec)),
                         submit_act=lambda r: None, get_version=lambda: 0, get_weights=lambda: None,
                         port=port, pub_port=pub, next_job=next_job)
    svc.start()
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=port, actor_id="a", config_hash="h",
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=0.4,
                           reconnect_after=100)
    try:
        client.connect(give_up_after_s=10)
        assert client.jobs and client.spec == spec
        caplog.set_level(logging.WARNING, logger="tandem.actor.client")
        t0 = time.monotonic()
        assert client.get_job(0) is None
        assert time.monotonic() - t0 < 0.9
        assert client.get_job(1) is None  # still slow: no second warning
        warnings = [r for r in caplog.records if "no job from the learner" in r.getMessage()]
        assert len(warnings) == 1
        slow.set()
        time.sleep(1.5)  # the late answers for episodes 0 and 1 arrive now
        # episode 2: gets the next job; the stale answers for 0 and 1 are skipped
        assert q.pending() == 0
        assert client.get_job(2) is None  # the queue is empty: no_job
        q.put(Job(2, seed=7, group_id=3))
        assert client.get_job(3) == Job(2, seed=7, group_id=3)
        assert client.get_job(3) == Job(2, seed=7, group_id=3)  # asking again: the same job
    finally:
        client.close()
        svc.stop()
        svc.join(2)
        ctx.destroy(0)
