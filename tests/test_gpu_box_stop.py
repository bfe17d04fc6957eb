"""launch/gpu_box.sh stop: SIGTERM to every process group of a run, a wait, then SIGKILL to the
ones left, naming them (so that a run's log says which process did not stop)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


def _spawn(cmd: list[str]) -> subprocess.Popen:
    """A process in a group of its own, reaped as soon as it exits (as the launcher's orphans
    are by init): a zombie would still answer ``kill -0``."""
    p = subprocess.Popen(cmd, start_new_session=True)
    threading.Thread(target=p.wait, daemon=True).start()
    return p


def test_stop_terms_every_group_then_kills_and_names_the_ones_left(tmp_path):
    polite = _spawn(["sleep", "1000"])
    stubborn = _spawn(["bash", "-c", "trap '' TERM; while true; do sleep 0.2; done"])
    (tmp_path / "pids").write_text(f"learner {polite.pid}\nactor-0 {stubborn.pid}\n")
    try:
        time.sleep(0.3)   # the trap is set
        t0 = time.monotonic()
        out = subprocess.run(["bash", str(ROOT / "launch" / "gpu_box.sh"), "stop", "--run-dir", str(tmp_path)],
                             env={**os.environ, "TANDEM_STOP_WAIT_S": "2"}, capture_output=True, text=True,
                             timeout=30)
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        polite.wait(5)
        stubborn.wait(5)
        assert f"actor-0 (pid {stubborn.pid}) still running 2 s after SIGTERM; SIGKILL" in out.stderr, out.stderr
        assert "learner" not in out.stderr, out.stderr   # it stopped on SIGTERM
        assert took >= 2.0
    finally:
        for p in (polite, stubborn):
            if _alive(p):
                p.kill()


def test_stop_returns_once_every_process_has_stopped(tmp_path):
    polite = _spawn(["sleep", "1000"])
    (tmp_path / "pids").write_text(f"learner {polite.pid}\n")
    try:
        t0 = time.monotonic()
        out = subprocess.run(["bash", str(ROOT / "launch" / "gpu_box.sh"), "stop", "--run-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert time.monotonic() - t0 < 5 and polite.wait(5) is not None
    finally:
        if _alive(polite):
            polite.kill()


def _collect(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "launch" / "gpu_box.sh"), "collect", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=30)


def test_collect_waits_for_the_files_then_packs_what_exists(tmp_path):
    """launch/gpu_box.sh collect: waits for --until files to be non-empty, packs the paths that
    exist (naming the ones that do not), and packs them even when the wait ends without every
    file (exit 3); with --need absent it stops at once (exit 4)."""
    import tarfile

    (tmp_path / "r" / "res").mkdir(parents=True)
    (tmp_path / "r" / "res" / "metrics.jsonl").write_text('{"updates": 1}\n')
    threading.Timer(1.0, lambda: (tmp_path / "r" / "done").write_text("ok")).start()
    t0 = time.monotonic()
    out = _collect(tmp_path, "--to", "out", "--until", "r/done", "--timeout", "20", "r/res", "r/absent")
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - t0 < 15   # it stopped waiting when the file came
    assert "r/absent does not exist" in out.stderr
    with tarfile.open(tmp_path / "out" / "collect.tgz") as tar:
        assert "r/res/metrics.jsonl" in tar.getnames()

    late = _collect(tmp_path, "--to", "out2", "--until", "r/never", "--timeout", "2", "r/res")
    assert late.returncode == 3 and "still missing after" in late.stdout and "r/never" in late.stdout
    with tarfile.open(tmp_path / "out2" / "collect.tgz") as tar:   # what existed came back anyway
        assert "r/res/metrics.jsonl" in tar.getnames()

    (tmp_path / "r" / "half").write_text("")   # created, not yet written: still missing
    half = _collect(tmp_path, "--to", "out3", "--until", "r/half", "--timeout", "2", "r/res")
    assert half.returncode == 3 and "r/half" in half.stdout

    t0 = time.monotonic()
    gone = _collect(tmp_path, "--to", "out4", "--need", "r/lost", "--until", "r/never",
                    "--timeout", "20", "r/res")
    assert gone.returncode == 4 and "r/lost is not on this box" in gone.stdout
    assert time.monotonic() - t0 < 10   # it did not wait for r/never

    bad = _collect(tmp_path, "--until", "r/done", "r/res")
    assert bad.returncode == 2 and "--to" in bad.stderr
