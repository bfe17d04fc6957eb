"""Evaluation sweeps as jobs (learner/eval_sweep.py): every (task, init state) once, reissued
when its actor vanishes, counted once; and through real learner and actor processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from learner.eval_sweep import EvalSweep, sweep_jobs


def episode(actor: str, ep: int, group: int, *, success: bool, steps: int = 3, task: str = "t"):
    """The records of one finished episode (its steps then the is_last record)."""
    n = steps + 1
    arrays = {"episode": np.full(n, ep), "group_id": np.full(n, group),
              "success": np.zeros(n, bool), "reward": np.ones(n, np.float32),
              "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
              "is_last": np.zeros(n, bool)}
    arrays["success"][steps - 1] = success
    arrays["terminated"][steps - 1] = success
    arrays["truncated"][steps - 1] = not success
    arrays["is_last"][steps] = True
    return SimpleNamespace(actor_id=actor, arrays=arrays, tasks=[task] * n), np.ones(n, bool)


def test_jobs_cover_every_task_and_init_state_once_deterministically():
    jobs = sweep_jobs([3, 5], 4, seed=7)
    assert [(j.task_id, j.init_state) for j in jobs] == [(t, i) for t in (3, 5) for i in range(4)]
    assert all(j.deterministic for j in jobs) and [j.group_id for j in jobs] == list(range(8))
    assert len({j.seed for j in jobs}) == 8
    with pytest.raises(ValueError, match="init_states"):
        sweep_jobs(2, 0)
    with pytest.raises(ValueError, match="unknown keys"):
        EvalSweep.from_config({"task_ids": 2, "init_state": 5})


def test_a_vanished_actors_job_is_reissued_and_counted_once():
    now = [0.0]
    sw = EvalSweep(sweep_jobs(2, 2), job_timeout_s=10.0, clock=lambda: now[0])
    got = [sw.next_job("a", e) for e in range(4)]
    assert [(j.task_id, j.init_state) for j in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sw.next_job("a", 0) is got[0]  # a retried ask gets the same job
    assert sw.next_job("b", 0) is None  # nothing left to hand out
    for e, ok in ((0, True), (1, False), (2, True)):  # job 3's actor vanished
        sw.on_records(*episode("a", e, got[e].group_id, success=ok, task=f"task {got[e].task_id}"))
    assert not sw.done and sw.reissue_timed_out() == 0
    now[0] = 11.0
    assert sw.reissue_timed_out() == 1  # only job 3: the others have outcomes
    again = sw.next_job("b", 1)
    assert again.group_id == got[3].group_id
    sw.on_records(*episode("b", 1, again.group_id, success=True, task="task 1"))
    sw.on_records(*episode("a", 3, got[3].group_id, success=False, task="task 1"))  # late: ignored
    sw.on_records(*episode("c", 0, -1, success=True))  # ran without a job
    assert sw.done
    r = sw.report()
    assert r["overall"] == {"episodes": 4, "jobs": 4, "success": 0.75, "return": 3.0}
    assert r["per_task"]["0: task 0"]["success"] == 0.5
    assert r["per_task"]["0: task 0"]["failed_init_states"] == [1]
    assert r["per_task"]["1: task 1"]["success"] == 1.0  # the reissued run counted, not the late one
    assert r["counters"]["reissued"] == 1 and r["counters"]["duplicates"] == 1
    assert r["counters"]["foreign"] == 1


@pytest.mark.slow
def test_eval_sweep_through_the_learner_and_two_actors(tmp_path):
    from test_integration import Run

    run = Run(tmp_path)
    run.env = "point_reach"
    try:
        run.learner("mode=eval", "eval.sweep={task_ids: [0, 2], init_states: 3}")
        actors = [run.actor("a0"), run.actor("a1")]
        run.wait(lambda: (run.dir / "eval_report.json").exists(), 240, "eval report")
        report = json.loads((run.dir / "eval_report.json").read_text())
        assert report["overall"]["jobs"] == 6 and report["overall"]["episodes"] == 6
        assert sorted(report["per_task"]) == ["0: reach the red target", "2: reach the blue target"]
        assert all(r["episodes"] == 3 for r in report["per_task"].values())
        assert report["counters"]["handed_out"] >= 6
        assert (run.dir / "eval_report.md").exists()
        for a in actors:
            run.wait(lambda: a.poll() is not None, 60, "actors to stop when the sweep is done")
            assert a.returncode == 0
    finally:
        run.stop_all()
