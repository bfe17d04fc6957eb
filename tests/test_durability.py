"""Crash safety of the LeRobot episode store with real processes killed by SIGKILL, and disk
full on a real size-limited filesystem (tmpfs in a user namespace) or, where none can be
made, ENOSPC raised from lerobot's real parquet write path.

The worker (this file run as a script) writes episodes through the store's writer thread
and prints one JSON line per event; "durable" lines are what the learner would acknowledge.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.core.spec import EnvSpec  # noqa: E402

VSPEC = EnvSpec(state_dim=3, action_dim=2, cameras={"front": (32, 32, 3)})
LENGTH = 24  # steps per episode (+ 1 final record)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


# ---- worker side ----------------------------------------------------------------------------


def _emit(**kw):
    print(json.dumps(kw), flush=True)


def worker(root: str, video: bool) -> None:
    from data.store import Episode, EpisodeStore
    from test_buffer_helpers import episode_batch

    store = EpisodeStore(root, VSPEC, video=video, fps=10)  # opening recovers
    _emit(event="open", episodes=store.total_episodes, acked=store.acked)
    store.on_durable = lambda done, dropped: [
        _emit(event="durable", episode=e.episode, last_seq=e.last_seq) for e in done]
    store.start()
    ep = store.max_episode.get("w", -1) + 1
    seq = store.acked.get("w", -1) + 1
    while True:
        b = episode_batch("w", seq, ep, LENGTH, spec=VSPEC, success=ep % 2 == 0)
        store.submit(Episode.from_batch(b))
        seq, ep = seq + len(b), ep + 1
        while store.pending > 2:
            time.sleep(0.005)


def zygote(root: str, video: bool) -> None:
    """Import lerobot once, then fork a fresh worker process per line read from stdin (so
    that each kill/restart cycle does not pay the import again)."""
    from data.store.compat import import_lerobot  # lerobot is imported on first store use

    import_lerobot()
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                worker(root, video)
            finally:
                os._exit(1)
        _emit(event="forked", pid=pid)
        _, status = os.waitpid(pid, 0)
        _emit(event="exited", pid=pid, signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)


def diskfull_worker(root: str) -> None:
    """Run inside a mount namespace with a small tmpfs at ``root``'s parent."""
    from data.store import Episode, EpisodeStore, is_disk_full
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from test_buffer_helpers import episode_batch

    store = EpisodeStore(root, VSPEC, video=False, fps=10)
    seq, ep, committed, error = 0, 0, 0, None
    while error is None and ep < 400:
        b = episode_batch("w", seq, ep, LENGTH, spec=VSPEC)
        try:
            store.write([Episode.from_batch(b)])
            committed += 1
            seq, ep = seq + len(b), ep + 1
        except OSError as exc:
            error = exc
    # the failed commit was rolled back: the earlier episodes load
    free_after = shutil.disk_usage(root).free
    n = len(LeRobotDataset("tandem/replay", root=root, video_backend="pyav"))
    store2 = EpisodeStore(root, VSPEC, video=False, fps=10)  # a restart recovers cleanly too
    # free space, then the same episode goes in
    (Path(root).parent / "filler").unlink()
    store2.write([Episode.from_batch(episode_batch("w", seq, ep, LENGTH, spec=VSPEC))])
    n2 = len(LeRobotDataset("tandem/replay", root=root, video_backend="pyav"))
    _emit(event="diskfull", errno=getattr(error, "errno", None), error=repr(error),
          disk_full=is_disk_full(error), committed=committed,
          frames=n, frames_after=n2, episodes_after=store2.total_episodes, free_after=free_after,
          ok=bool(error is not None))


# ---- test side --------------------------------------------------------------------------------


def _check_dataset(root: Path, acked: set[int]) -> list[int]:
    """The dataset loads with lerobot, holds every acked episode, each one whole and right."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from data.store import read_episodes
    from test_buffer_helpers import pixel

    ds = LeRobotDataset("tandem/replay", root=root, video_backend="pyav")
    assert len(ds) == ds.meta.total_episodes * (LENGTH + 1)
    last = ds[len(ds) - 1]
    assert bool(last["is_last"]) and int(last["frame_index"]) == LENGTH
    present = []
    for e in read_episodes(root):
        c = e.columns
        ep = int(c["actor_episode"][0])
        present.append(ep)
        assert len(e) == LENGTH + 1 and (c["frame_index"] == np.arange(LENGTH + 1)).all()
        assert (c["actor_episode"] == ep).all() and c["is_last"].tolist() == [False] * LENGTH + [True]
        assert (c["observation.state"][:, 0] == 1000 * ep + np.arange(LENGTH + 1)).all()
        px = e.images["observation.images.front"][:, 16, 16, 0].astype(int)
        want = np.array([pixel(ep, t) for t in range(LENGTH + 1)])
        assert np.abs(px - want).max() <= 12, (ep, px, want)  # video is lossy
    assert present == sorted(set(present)), "an episode is in the dataset twice"
    missing = acked - set(present)
    assert not missing, f"acknowledged episodes missing after the crash: {sorted(missing)}"
    return present


class Zygote:
    def __init__(self, root: Path, video: bool, log: Path):
        self.p = subprocess.Popen([sys.executable, __file__, "zygote", str(root), str(int(video))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log, "ab"), env=ENV, text=True)
        self.log = log

    def _next(self, deadline: float) -> dict:
        line = self.p.stdout.readline()
        assert line, f"worker died:\n{self.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "worker too slow"
        return json.loads(line)

    def run_until_killed(self, n_durable: int, delay: float) -> tuple[set[int], dict]:
        """Start a worker, let ``n_durable`` episodes become durable, wait ``delay`` s (the
        writer is busy with the next commit by then) and SIGKILL it."""
        self.p.stdin.write("fork\n")
        self.p.stdin.flush()
        deadline = time.monotonic() + 240
        acked, opened, pid = set(), None, None
        while len(acked) < n_durable:
            msg = self._next(deadline)
            if msg["event"] == "forked":
                pid = msg["pid"]
            elif msg["event"] == "open":
                opened = msg
            elif msg["event"] == "durable":
                acked.add(msg["episode"])
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        while True:
            msg = self._next(deadline)
            if msg["event"] == "exited":
                assert msg["signal"] == signal.SIGKILL
                return acked, opened
            if msg["event"] == "durable":  # committed just before the kill
                acked.add(msg["episode"])

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)


@pytest.mark.slow
def test_sigkill_mid_write_leaves_a_loadable_dataset_with_every_acked_episode(tmp_path):
    """Kill the writing process at random points of its commits, four times; after each
    restart the dataset loads with lerobot, holds every acknowledged episode whole, nothing
    half written, and the writer continues without gaps or duplicates."""
    from data.store import EpisodeStore

    root = tmp_path / "dataset"
    rng = random.Random(0)
    acked_all: set[int] = set()
    zygote = Zygote(root, True, tmp_path / "worker.log")
    from data.store.compat import import_lerobot

    import_lerobot()  # import here while the worker imports there
    partial = []
    try:
        for cycle in range(4):
            t0 = time.monotonic()
            acked, opened = zygote.run_until_killed(2, rng.uniform(0.02, 0.6))
            t1 = time.monotonic()
            acked_all |= acked
            if cycle:  # the restarted writer saw every episode acked before the crash
                assert opened["episodes"] >= len(acked_all - acked)
            store = EpisodeStore(root, VSPEC, video=True, fps=10)  # a restart recovers
            partial.append(store.recovered_files)
            present = _check_dataset(root, acked_all)  # then lerobot loads it
            print(f"cycle {cycle}: run {t1 - t0:.1f}s, check {time.monotonic() - t1:.1f}s, "
                  f"{len(present)} episodes, {store.recovered_files} partial files removed")
            assert present == list(range(len(present))), present  # no gap, no duplicate
            assert store.total_episodes == len(present)
            leftovers = [p for p in root.rglob("*") if p.is_file() and (
                "images" in p.parts or p.name.startswith("tmp") or p.suffix == ".tmp")]
            assert not leftovers, leftovers
        # the writer is always busy: kills land mid-commit (partial files were rolled back)
        assert sum(1 for n in partial if n) >= 1, partial
    finally:
        zygote.close()


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespace to mount a small tmpfs in")
def test_disk_full_on_a_real_small_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=3m tmpfs {mnt} && "
              f"head -c 2500000 /dev/zero > {mnt}/filler && "
              f"exec {sys.executable} {__file__} diskfull {mnt}/dataset")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                       env=ENV, timeout=240)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, r.stderr[-3000:]
    res = lines[-1]
    assert res["ok"] and res["disk_full"] == "disk full", res["error"]
    assert res["committed"] >= 1 and res["frames"] == res["committed"] * (LENGTH + 1)
    assert res["episodes_after"] == res["committed"] + 1
    assert res["frames_after"] == res["frames"] + LENGTH + 1


def test_disk_full_is_a_clear_error_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """ENOSPC raised from lerobot's real parquet write path (pyarrow's writer), through the
    store's writer thread, with ingest and sampling going on."""
    import pyarrow.parquet as pq

    from data.store import EpisodeStore, read_episodes
    from data.replay import ReplayBuffer
    from learner.ingest import Ingest
    from test_buffer_helpers import SPEC, episode_batch

    store = EpisodeStore(tmp_path / "dataset", SPEC, video=False, retry_min_s=0.2,
                         retry_max_s=0.4).start()
    acks = []
    ingest = Ingest(ReplayBuffer(400, SPEC), store=store, on_ack=lambda a, s: acks.append(s))
    ingest.add(episode_batch("a0", 0, 0, 5))
    assert store.flush(60) and acks == [5]
    full = {"on": True}
    real = pq.ParquetWriter.write_table

    def write_table(self, *a, **kw):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)
    caplog.set_level(logging.WARNING)
    ingest.add(episode_batch("a0", 6, 1, 5))
    ingest.add(episode_batch("a0", 12, 2, 5))
    time.sleep(1.5)
    assert store.pending == 2 and acks == [5] and ingest.acked["a0"] == 5
    assert store.counters["disk_full"] >= 1
    assert "disk full" in store.last_error and "stay readable" in store.last_error
    assert "disk full writing episodes" in caplog.text
    assert len(ingest.sink.sample(32)["reward"]) == 32  # training samples on
    assert [int(e.columns["actor_episode"][0]) for e in read_episodes(store.root)] == [0]
    full["on"] = False  # space freed
    assert store.flush(60)
    assert acks[-1] == 17 and store.last_error is None
    assert [int(e.columns["actor_episode"][0]) for e in read_episodes(store.root)] == [0, 1, 2]
    store.close()


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote(sys.argv[2], bool(int(sys.argv[3])))
    elif sys.argv[1] == "diskfull":
        diskfull_worker(sys.argv[2])
