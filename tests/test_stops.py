"""Stops that work however a process was started (issue 24, class 8): a learner and an actor
started in the background inherit SIGINT ignored (as from a script's ``cmd &``); ``kill -INT``
still stops each cleanly: the learner writes its checkpoint, the actor keeps its spool."""

import signal
import subprocess

import pytest

from learner.checkpoint import latest_checkpoint
from test_integration import ENV, ROOT, Run

pytestmark = pytest.mark.slow


class BackgroundRun(Run):
    """Processes started as a non-interactive shell starts background jobs: SIGINT ignored."""

    def _start(self, args, log):
        self.dir.mkdir(parents=True, exist_ok=True)
        f = open(self.dir.parent / log, "ab")
        p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        p.log = self.dir.parent / log
        self.procs.append(p)
        return p


@pytest.fixture
def run(tmp_path):
    r = BackgroundRun(tmp_path)
    yield r
    for p in r.procs:  # SIGINT may be ignored (the old code): SIGKILL what is left
        if p.poll() is None:
            p.kill()
            p.wait()



def _interrupt(proc, who: str, timeout: float) -> None:
    """kill -INT ``proc``; it must exit 0 within ``timeout``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the {who} ignored SIGINT:\n" + proc.log.read_text()[-2000:]) from None
    assert proc.returncode == 0, proc.log.read_text()[-3000:]

def test_sigint_stops_a_background_learner_and_actor_cleanly(run):
    learner = run.learner("algo.learning_starts=50", "trainer.checkpoint_every=0",
                          "trainer.checkpoint_every_s=0", "buffer.video=false")
    actor = run.actor("a0", "spool.batch_size=8")
    run.wait(lambda: run.status().get("updates", 0) >= 3, 180, "the learner to train")
    assert latest_checkpoint(run.dir / "checkpoints") is None  # none yet: only the stop writes one
    _interrupt(actor, "actor", 30)
    assert (run.dir / "spool" / "a0" / "meta.json").exists()  # the spool is kept
    _interrupt(learner, "learner", 60)
    assert latest_checkpoint(run.dir / "checkpoints") is not None, "no checkpoint at the stop"
    assert "SIGINT: stopping cleanly" in learner.log.read_text()
