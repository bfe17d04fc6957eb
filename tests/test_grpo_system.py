"""GRPO through the real system: the learner (algo=grpo, policy=mlp, env=point_reach) runs
in this process, actors are real processes on loopback sockets.

- Jobs are issued in groups: every job of a group has the same task and initial state and
  the group's own id, and every episode run for a job carries that id in every record.
- An actor killed (SIGKILL) while it holds a job: the job is handed out again after
  ``job_timeout_s``, another actor runs it, and the round completes (not by its timeout).
- Rounds update the policy and advance the weights version; the success rate rises.

The rise is asserted only with ``TANDEM_LEARNING_TESTS=1`` (then the run goes on until it
rises or 180 s pass). In the default suite the run ends after the reissue checks, 20 s and
5 updates (dynamic sampling drops most groups near the 0.05 start, so how many updates 20 s
hold varies); the rise has no pre-registered rule yet (seeds, held-out episodes, a threshold
over 5 seeds), so the default suite does not assert it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pytest

from tandem_testutil import ROOT, free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
GROUP, GROUPS, TASKS = 8, 4, 4
LEARNING = bool(os.environ.get("TANDEM_LEARNING_TESTS"))
RUN_S = 180 if LEARNING else 20  # default suite: the mechanism checks, then this long
TARGET = 0.6  # success over the last 5 rounds that ends the run early


def overrides(run_dir, port, pub) -> list[str]:
    """What learner and actors share: a state-and-image point_reach with its 0/1 success
    (the target's position in the state, so a minute of rounds shows learning), a small CNN,
    a wide initial policy std."""
    return ["env=point_reach", f"env.num_tasks={TASKS}", "env.state_has_target=true",
            "policy=mlp", "policy.hidden_dims=[64,64]", "++policy.cnn_channels=[8]",
            "++policy.image_embed_dim=16", "++policy.log_std_min=-3.0", "++policy.log_std_max=1.0",
            f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
            "transport.timeout_s=1.0", "transport.heartbeat_s=0.5"]


def start_actor(tmp, common, actor_id, seed):
    log = tmp / f"{actor_id}.log"
    p = subprocess.Popen([sys.executable, "-m", "actor", *common, f"actor_id={actor_id}",
                          "spool.fsync=false", "log_every_s=5", f"seed={seed}"],
                         cwd=ROOT, env=ENV, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    p.log, p.actor_id = log, actor_id
    return p


def recent_success(rounds, n=5) -> float:
    return float(np.mean([r["round_success"] for r in rounds[-n:]])) if len(rounds) >= 2 * n else 0.0


def wait_for(cond, timeout, what, lt, procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        assert lt.thread.is_alive(), lt.error
        time.sleep(0.05)
    logs = "\n".join(f"--- {p.log.name}\n{p.log.read_text()[-2000:]}" for p in procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def test_grpo_groups_reissue_and_learning(tmp_path):
    from learner.app import Learner
    from test_extras_e2e import LearnerThread, compose_cfg

    run_dir = tmp_path / "run"
    port, pub = free_port(), free_port()
    common = overrides(run_dir, port, pub)
    cfg = compose_cfg("learner", common + [
        "algo=grpo", f"algo.group_size={GROUP}", f"algo.batch_groups={GROUPS}",
        f"algo.task_ids=[{','.join(map(str, range(TASKS)))}]", "algo.job_timeout_s=6",
        "algo.round_timeout_s=120", "device=cpu", "logging.wandb=disabled", "logging.every_s=2",
        "trainer.num_threads=1",
        # the episode store's per-frame image encoding would take most of 2 CPU cores here
        # (30 rounds in the time instead of ~90); tests/test_ppo_learning.py runs with it
        "buffer.persist=false"])
    learner = Learner(cfg)
    source = learner.jobs
    assert source is learner.builder.jobs() and source is not None
    rounds: list[dict] = []
    step = learner.algo.step

    def observed():  # every round's metrics, as the learner computes them
        m = step()
        if m is not None:
            rounds.append(dict(m))
        return m

    learner.algo.step = observed
    finished = []
    learner.data.queue.on_finished.append(finished.append)
    lt = LearnerThread(learner).start()
    procs = [start_actor(tmp_path, common, "a0", 0), start_actor(tmp_path, common, "a1", 1000)]
    t0 = time.monotonic()
    try:
        wait_for(lambda: learner.algo.version >= 2, 120, "two rounds", lt, procs)
        # SIGKILL an actor while it holds a job of an open round. The job it holds after its
        # death is the one that must go out again (if it died just after finishing one
        # episode and before asking for the next, it holds none: try another actor).
        victim, stuck = procs[1], {}
        for attempt in range(3):
            wait_for(lambda: bool(source.held_by(victim.actor_id)), 30,
                     f"{victim.actor_id} to hold a job", lt, procs)
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            time.sleep(1.0)  # whatever it sent before dying has arrived
            stuck = source.held_by(victim.actor_id)
            if stuck:
                break
            victim = start_actor(tmp_path, common, f"k{attempt}", 3000 + attempt)
            procs.append(victim)
        assert stuck, "no actor died holding a job"
        killed_job, killed_round = next(iter(stuck.items()))
        killed_actor = victim.actor_id
        reissued_before = source.counters["reissued"]
        procs.append(start_actor(tmp_path, common, "a2", 2000))
        wait_for(lambda: any(r.get("round_id") == killed_round for r in rounds), 90,
                 f"round {killed_round} (of the killed actor's job {killed_job}) to finish", lt, procs)
        assert source.counters["reissued"] > reissued_before
        def run_done() -> bool:  # the learning run: its time or the target; else RUN_S and 5 updates
            if LEARNING:
                return time.monotonic() - t0 > RUN_S or recent_success(rounds) >= TARGET
            # dynamic sampling drops the groups that all failed, which near a 0.05 start is most of
            # them: the number of updates in RUN_S varies, so the run goes on until 5 have been made
            return time.monotonic() - t0 > RUN_S and sum("policy_loss" in r for r in rounds) >= 5
        wait_for(run_done, RUN_S + (10 if LEARNING else 120), "the run", lt, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        lt.stop(120)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    killed = next(r for r in rounds if r.get("round_id") == killed_round)
    assert killed["round_timed_out"] == 0.0, f"the killed actor's round timed out: {killed}"
    assert killed["round_episodes"] == GROUP * GROUPS, killed
    # the killed job ran again, to its end, on another actor
    runs = {key: job for key, job in source.assigned.items() if job.job_id == killed_job}
    done_elsewhere = [key for key in runs if key[0] != killed_actor
                      and any(e.key == key and e.group_id == runs[key].group_id for e in finished)]
    assert done_elsewhere, f"job {killed_job} was not run again: {runs}"

    # groups: one (task, init state) per group id, group_size distinct jobs for complete rounds
    jobs_of_group = defaultdict(set)
    for job in source.assigned.values():
        jobs_of_group[job.group_id].add(job)
    for gid, jobs in jobs_of_group.items():
        assert len({(j.task_id, j.init_state) for j in jobs}) == 1, (gid, jobs)
        assert len({j.job_id for j in jobs}) <= GROUP
    # every episode of a job carries the job's group id in every record; others carry -1. An
    # actor whose job request timed out (a loaded machine) ran the episode as it liked, -1, while
    # the learner had handed the job out: that job went out again (GroupJobSource.episode_finished)
    checked, missed = 0, 0
    for ep in finished:
        ids = set(ep.arrays["group_id"].tolist())
        assert len(ids) == 1, f"group id changes within episode {ep.key}"
        job = source.assigned.get(ep.key)
        if job is not None and ids == {-1}:
            missed += 1
            continue
        assert ids == {job.group_id if job is not None else -1}, (ep.key, ids, job)
        checked += job is not None
    assert checked >= 2 * GROUP * GROUPS
    assert source.counters["reissued"] >= missed

    complete = [r for r in rounds if r["round_timed_out"] == 0.0]
    updated = [r for r in rounds if "policy_loss" in r]
    first = np.mean([r["round_success"] for r in rounds[:2]])
    last = recent_success(rounds)
    print(f"\nGRPO point_reach: {len(rounds)} rounds ({len(complete)} complete, "
          f"{len(updated)} with an update), version {learner.algo.version}, "
          f"{len(finished)} episodes; jobs reissued {source.counters['reissued']}; success of "
          f"rounds 1-2 {first:.2f} -> last 5 rounds {last:.2f}; dynamic sampling dropped "
          f"{rounds[-1]['groups_dynamic_dropped']:.0f} groups; update time per round "
          f"{np.mean([r['round_s'] for r in updated]):.1f} s; queue {dict(learner.data.queue.counters)}, "
          f"jobs {source.status()}")
    assert learner.algo.version == len(updated) >= 5
    if LEARNING:
        assert last > first + 0.25, f"success did not rise: {first:.2f} -> {last:.2f}"
