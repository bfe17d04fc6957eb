"""The whole learner process object (in-process, real sockets, a real actor): checkpoints on
a wall-clock interval, the restart log says how old the resumed checkpoint is, and a socket
thread that dies stops the learner loudly with its cause."""

import logging
import re
import threading
import time

import pytest

from tandem_testutil import free_port


@pytest.mark.slow
def test_wall_clock_checkpoints_a_dead_socket_thread_and_the_resume_age(tmp_path, caplog):
    from actor.app import Actor
    from learner.app import Learner
    from learner.checkpoint import latest_checkpoint
    from test_extras_e2e import LearnerThread, actor_cfg, learner_cfg

    run_dir = tmp_path / "run"
    port, pub = free_port(), free_port()
    # by update count never (0); by wall clock every second
    learner = Learner(learner_cfg(run_dir, port, pub, "trainer.checkpoint_every=0",
                                  "trainer.checkpoint_every_s=1", "buffer.persist=false"))
    lt = LearnerThread(learner).start()
    acfg = actor_cfg(run_dir, port, pub, "a0", "max_episodes=1000")
    actor = Actor(acfg)
    at = threading.Thread(target=actor.run, daemon=True)
    at.start()
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(run_dir / "checkpoints") is None and time.monotonic() < deadline:
            time.sleep(0.2)
        first = latest_checkpoint(run_dir / "checkpoints")
        assert first is not None, "no checkpoint within 120 s although checkpoint_every_s=1"
        assert learner.algo.updates > 0 and lt.thread.is_alive()  # written while training on
        actor._stopping = True
        at.join(60)
        # a bug elsewhere hands the socket thread a reply without frames: it dies
        learner.service.outbox().send_multipart([b"R"])
        lt.thread.join(30)
        assert not lt.thread.is_alive(), "the learner kept running without its socket thread"
        assert isinstance(lt.error, RuntimeError) and "socket thread died" in str(lt.error)
        cause = lt.error.__cause__  # the injected fault, not something else
        assert isinstance(cause, ValueError) and "at least one frame" in str(cause), cause
    finally:
        actor._stopping = True
        at.join(60)
        if lt.thread.is_alive():
            lt.learner.stop()
            lt.thread.join(30)
    # a restart says how old the checkpoint it resumed from is
    time.sleep(1.1)
    with caplog.at_level(logging.INFO, logger="tandem.learner"):
        again = Learner(learner_cfg(run_dir, free_port(), free_port(), "buffer.persist=false"))
    try:
        line = next(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage())
        m = re.search(r"written (\d+)s ago", line)
        assert m and int(m.group(1)) >= 1, line
    finally:  # never started: release what the constructor opened
        again.data.close()
        again.metrics.close()
        again.ctx.destroy(0)


def test_a_second_sigterm_during_actor_shutdown_is_ignored(tmp_path):
    import signal

    from actor.app import Actor
    from test_extras_e2e import actor_cfg

    actor = Actor(actor_cfg(tmp_path / "run", free_port(), free_port(), "a0"))
    try:
        with pytest.raises(KeyboardInterrupt):  # the first one interrupts what runs
            actor._on_term(signal.SIGTERM, None)
        assert actor._stopping
        for _ in range(3):  # later ones arrive while it closes: no exception, no traceback
            assert actor._on_term(signal.SIGTERM, None) is None
    finally:
        actor.close()


def test_the_demo_scripts_header_names_the_task_it_runs():
    """launch/demo.sh passes no env=: it runs the configs' default env, which its header names."""
    import yaml

    from tandem_testutil import ROOT

    defaults = {}
    for name in ("learner", "actor"):
        cfg = yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text())
        defaults[name] = next(d["env"] for d in cfg["defaults"] if isinstance(d, dict) and "env" in d)
    assert defaults["learner"] == defaults["actor"]
    env = defaults["learner"]
    script = (ROOT / "launch" / "demo.sh").read_text()
    header = "".join(line for line in script.splitlines(keepends=True) if line.startswith("#"))
    body = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any(" env=" in line for line in body)  # no env override: the default runs
    assert f"config/env/{env}.yaml" in header
    title = yaml.safe_load((ROOT / "config" / "env" / f"{env}.yaml").read_text())["name"]
    assert title == env
