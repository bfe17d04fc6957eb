"""A learner and actors as real processes on free loopback ports: exactly-once delivery,
version advance, SIGKILL of an actor and of the learner, config mismatch, evaluation."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_testutil import ROOT, free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


class Run:
    def __init__(self, tmp: Path):
        self.dir = tmp / "run"
        self.port, self.pub = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self.env = "reacher"

    def common(self):
        return [f"env={self.env}", f"run_dir={self.dir}", f"transport.port={self.port}",
                f"transport.pub_port={self.pub}",
                "transport.timeout_s=1.0", "transport.heartbeat_s=0.5"]

    def learner(self, *over, log="learner.log"):
        args = [sys.executable, "-m", "learner", *self.common(), "logging.wandb=disabled",
                "logging.every_s=0.5", "algo.learning_starts=100", "algo.publish_every=5",
                "trainer.num_threads=1", "algo.batch_size=64", *over]
        return self._start(args, log)

    def actor(self, actor_id, *over, log=None):
        args = [sys.executable, "-m", "actor", *self.common(), f"actor_id={actor_id}",
                "spool.fsync=false", "log_every_s=1", *over]
        return self._start(args, log or f"{actor_id}.log")

    def _start(self, args, log):
        self.dir.mkdir(parents=True, exist_ok=True)
        f = open(self.dir.parent / log, "ab")
        p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
        p.log = self.dir.parent / log
        self.procs.append(p)
        return p

    def status(self) -> dict:
        try:
            return json.loads((self.dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def spool_acked(self, actor_id) -> int:
        """What the learner had acknowledged: just below the actor's oldest spooled batch."""
        files = sorted((self.dir / "spool" / actor_id).glob("*.msg"))
        if not files:
            return self.spool_meta(actor_id)["next_seq"] - 1
        return int(files[0].stem.split("-")[0]) - 1

    def spool_meta(self, actor_id) -> dict:
        return json.loads((self.dir / "spool" / actor_id / "meta.json").read_text())

    def wait(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            for p in self.procs:
                if p.poll() not in (None, 0, -signal.SIGKILL, -signal.SIGINT):
                    raise AssertionError(f"process exited {p.returncode}:\n{p.log.read_text()[-3000:]}")
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.log.name}\n{p.log.read_text()[-2000:]}" for p in self.procs)
        raise AssertionError(f"timed out waiting for {what}; status={self.status()}\n{logs}")

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop_all()


def test_two_actors_exactly_once_and_versions_advance(run):
    run.learner()
    a = [run.actor(f"a{i}", "max_episodes=6", f"seed={i * 100}") for i in range(2)]
    for p in a:
        run.wait(lambda p=p: p.poll() is not None, 240, "actors to finish")
        assert p.returncode == 0, p.log.read_text()[-3000:]
    records = {f"a{i}": run.spool_meta(f"a{i}")["next_seq"] for i in range(2)}
    # 6 episodes x (50 steps + 1 final observation)
    assert records == {"a0": 306, "a1": 306}
    run.wait(lambda: run.status().get("received") == {k: v - 1 for k, v in records.items()}, 20,
             "all records received")
    st = run.status()
    assert st["stored"] == sum(records.values())  # each record stored exactly once
    assert st["episodes"] == 12 and st["env_steps"] == 600
    run.wait(lambda: run.status().get("version", 0) >= 3, 60, "weight versions to advance")
    # the transitions themselves carry the versions that produced them, and those advanced
    import pandas as pd

    run.wait(lambda: len(list((run.dir / "dataset").rglob("data/**/*.parquet"))) > 0, 60, "the dataset")
    versions = pd.concat(pd.read_parquet(f, columns=["policy_version"])
                         for f in (run.dir / "dataset").rglob("data/**/*.parquet"))["policy_version"]
    assert versions.nunique() >= 3 and versions.min() == 0
    for i in range(2):
        assert not list((run.dir / "spool" / f"a{i}").glob("*.msg")), "acked batches left in spool"


def test_actor_sigkill_and_restart_resumes_without_loss_or_duplicates(run):
    run.learner()
    a = run.actor("a0", "spool.batch_size=8")
    run.wait(lambda: run.status().get("received", {}).get("a0", -1) > 200, 180, "first records")
    a.send_signal(signal.SIGKILL)
    a.wait()
    before = run.spool_meta("a0")
    b = run.actor("a0", "max_episodes=2", "spool.batch_size=8", log="a0-restart.log")
    run.wait(lambda: b.poll() is not None, 180, "restarted actor to finish")
    assert b.returncode == 0, b.log.read_text()[-3000:]
    after = run.spool_meta("a0")
    assert after["next_seq"] > before["next_seq"]
    assert after["next_episode"] > before["next_episode"]  # episode ids are never reused
    run.wait(lambda: run.status().get("received", {}).get("a0") == after["next_seq"] - 1, 20,
             "everything received")
    assert run.status()["stored"] == after["next_seq"]  # no record lost, none stored twice
    assert "connected to learner" in b.log.read_text()


def test_learner_sigkill_restart_from_checkpoint_receives_spooled_transitions(run):
    first = run.learner("trainer.checkpoint_every=20")
    # a small spool bound: while the learner is away the actor fills it, then waits
    a = run.actor("a0", "mode=local", "spool.batch_size=8", "spool.max_mb=0.2")
    ckpts = run.dir / "checkpoints"
    run.wait(lambda: (ckpts / "latest").exists() and run.status().get("updates", 0) > 40, 180,
             "a checkpoint")
    old_id = run.status()["learner_id"]
    first.send_signal(signal.SIGKILL)
    first.wait()
    acked_at_kill = run.spool_acked("a0")
    # the actor keeps stepping with its local policy and spools what it cannot deliver
    run.wait(lambda: run.spool_meta("a0")["next_seq"] > acked_at_kill + 100, 120, "records to spool")
    run.wait(lambda: "spool full" in a.log.read_text(), 120, "the spool bound to hold the actor")
    second = run.learner("trainer.checkpoint_every=20", log="learner-restart.log")
    run.wait(lambda: "resumed from" in second.log.read_text(), 180, "resume")
    run.wait(lambda: run.status().get("learner_id") != old_id and run.status().get("stored", 0) > 100, 180,
             "spooled records to arrive")
    a.send_signal(signal.SIGINT)
    a.wait(30)
    # an actor stopped with a backlog sends it when it runs again
    b = run.actor("a0", "mode=local", "spool.batch_size=8", "spool.max_mb=0.2", "max_episodes=1",
                  log="a0-again.log")
    run.wait(lambda: b.poll() is not None, 180, "the actor to send its backlog and stop")
    assert b.returncode == 0, b.log.read_text()[-3000:]
    final = run.spool_meta("a0")["next_seq"]
    run.wait(lambda: run.status().get("received", {}).get("a0") == final - 1, 120, "all records")
    st = run.status()
    # everything the actor spooled after the old learner's last ack reached the new learner:
    # stored now, or dropped as a duplicate (of what the old learner had already made durable,
    # or of a batch resent after a timeout or by the restarted actor: a loaded machine makes those)
    assert st["stored"] <= final - 1 - acked_at_kill <= st["stored"] + st["duplicates"]
    # and no record is in the dataset twice, across both learners
    import pandas as pd

    rows = pd.concat(pd.read_parquet(f, columns=["actor_id", "actor_seq"])
                     for f in (run.dir / "dataset").rglob("data/**/*.parquet"))
    seqs = rows.loc[rows["actor_id"] == "a0", "actor_seq"]
    assert len(seqs) > acked_at_kill and seqs.is_unique
    assert st["updates"] > 20  # training continued from the checkpoint's counters


def test_config_mismatch_is_a_clear_error_on_both_sides(run):
    learner = run.learner()
    a = run.actor("a0", "policy.chunk_size=2")
    run.wait(lambda: a.poll() is not None, 180, "mismatched actor to exit")
    assert a.returncode == 2
    assert "config_mismatch" in a.log.read_text()
    assert "config_mismatch" in learner.log.read_text()


def test_eval_mode_reports_success_and_return_per_task(run):
    run.learner("mode=eval", "eval.episodes=4")
    a = run.actor("a0")
    run.wait(lambda: (run.dir / "eval_report.json").exists(), 180, "eval report")
    report = json.loads((run.dir / "eval_report.json").read_text())
    assert report["episodes"] >= 4
    (task, r), = report["per_task"].items()
    assert 0.0 <= r["success"] <= 1.0 and r["return"] < 0  # reacher returns are negative
    run.wait(lambda: a.poll() is not None, 30, "actor to stop when evaluation is done")
    assert a.returncode == 0
    run.wait(lambda: "updates" in run.status(), 30, "the final status")
    assert run.status()["updates"] == 0  # nothing trained
