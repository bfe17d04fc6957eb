"""A run carried to another machine (tools/carry_run.py): a real learner and actor on loopback
train and stop; the run folder is packed into parts of a bounded size, unpacked under another
path, and a learner started there resumes it: the same updates and policy version, the replay
refilled from the carried dataset, new episodes appended to it, and the metrics' wall clock
going on. A corrupted or missing part is named and nothing is extracted."""

from __future__ import annotations

import json
import re
import shutil
import signal

import pytest

from test_integration import Run
from tools.carry_run import pack, unpack, verify

pytestmark = pytest.mark.slow


def _episodes(run_dir) -> int:
    info = json.loads((run_dir / "dataset" / "meta" / "info.json").read_text())
    return int(info["total_episodes"])


def _wall(run_dir) -> list[float]:
    return [json.loads(line)["wall_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stored(run_dir) -> int:
    """Episodes in the run's dataset, -1 while it has none (or its info is being rewritten)."""
    try:
        return _episodes(run_dir)
    except (OSError, ValueError):
        return -1


def _train_and_stop(run: Run, episodes: int, actor_id: str, log: str, *, total: int, updates: int = 0):
    """A learner and an actor until the actor's ``episodes`` are done, the dataset holds
    ``total`` episodes and the learner made updates past ``updates``; then SIGTERM. (A carried
    run brings its old status.json: the wait reads the dataset and the counts, not the lag alone.)"""
    learner = run.learner("buffer.video=false", "buffer.commit_interval_s=0.3", log=log)
    actor = run.actor(actor_id, f"max_episodes={episodes}", "seed=7")
    run.wait(lambda: actor.poll() is not None, 240, f"{actor_id} to finish")
    assert actor.returncode == 0, actor.log.read_text()[-3000:]
    run.wait(lambda: (_stored(run.dir) >= total and run.status().get("store_lag_records", 1) == 0
                      and run.status().get("updates", 0) > updates),
             120, f"{total} episodes stored and an update past {updates} made")
    learner.send_signal(signal.SIGTERM)
    learner.wait(120)
    assert learner.returncode == 0, learner.log.read_text()[-3000:]
    return learner


def test_pack_unpack_resume_elsewhere(tmp_path):
    first = Run(tmp_path / "box1")
    try:
        _train_and_stop(first, 4, "a0", "learner.log", total=4)
    finally:
        first.stop_all()
    st = json.loads((first.dir / "status.json").read_text())
    updates, version = int(st["updates"]), int(st["version"])
    assert updates > 0 and _episodes(first.dir) == 4

    parts = tmp_path / "parts"
    m = pack(first.dir, parts, part_mib=0.25)
    assert len(m["parts"]) >= 3, m   # small parts: the stream really is cut
    assert all((parts / p["file"]).stat().st_size <= 0.25 * 2**20 for p in m["parts"])
    assert m["checkpoint"] == (first.dir / "checkpoints" / "latest").read_text().strip()

    # a corrupted part and a missing part are named; nothing is extracted
    bad = tmp_path / "bad"
    shutil.copytree(parts, bad)
    victim = bad / m["parts"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=m["parts"][1]["file"] + " is corrupted"):
        unpack(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=m["parts"][1]["file"] + " is missing"):
        verify(bad)

    # the next machine: another path, the learner resumes from the carried folder
    second = Run(tmp_path / "box2")
    unpack(parts, second.dir)
    with pytest.raises(FileExistsError, match="already holds a run"):
        unpack(parts, second.dir)
    assert not (second.dir / "spool").exists()
    wall_before = _wall(second.dir)
    try:
        learner2 = _train_and_stop(second, 2, "a1", "learner2.log", total=4 + 2, updates=updates)
    finally:
        second.stop_all()
    text2 = learner2.log.read_text()
    resumed = re.search(r"resumed from \S+ \(written .*? ago\): (\d+) updates, policy version (\d+)", text2)
    assert resumed, text2[-3000:]
    assert (int(resumed.group(1)), int(resumed.group(2))) == (updates, version)
    refill = re.search(r"refilled the buffer with (\d+) records", text2)
    assert refill and int(refill.group(1)) > 0, text2[-3000:]
    st2 = json.loads((second.dir / "status.json").read_text())
    assert int(st2["updates"]) > updates and int(st2["version"]) >= version
    assert _episodes(second.dir) == 4 + 2   # appended to the carried dataset
    wall_after = _wall(second.dir)[len(wall_before):]
    assert wall_after and min(wall_after) >= max(wall_before), "the curve's wall clock restarted"
