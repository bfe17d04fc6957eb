"""The LeRobot-backed episode store: lerobot reads what Tandem writes, resume refills the
buffer (video decoded once), any LeRobot dataset loads as demos, and the rerun viewer tool."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.store import Episode, EpisodeStore, StoreError
from data.replay import ReplayBuffer
from data.sampler import MixedSampler, build_replay
from data.core.spec import EnvSpec
from test_buffer_helpers import (SPEC, batch, check_successor, episode_batch, episode_records,
                                 pixel)

ROOT = Path(__file__).resolve().parents[1]


def write_episodes(root, n, *, video, length=6, first_ep=0, spec=SPEC, actor="a0"):
    store = EpisodeStore(root, spec, video=video, fps=10)
    seq = 0
    eps = []
    for e in range(first_ep, first_ep + n):
        b = episode_batch(actor, seq, e, length, spec=spec, success=e % 2 == 0,
                          terminated=e % 3 == 0, intervened_steps=(1,), policy_version=e,
                          task=f"task {e % 2}")
        eps.append(Episode.from_batch(b))
        seq += len(b)
    store.write(eps[:1])
    store.write(eps[1:])  # one commit with several episodes
    return store


@pytest.mark.parametrize("video", [False, True], ids=["images", "video"])
def test_lerobot_loads_what_tandem_writes(tmp_path, video):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path / "dataset"
    store = write_episodes(root, 4, video=video)
    assert store.total_episodes == 4 and store.total_frames == 28
    ds = LeRobotDataset("tandem/replay", root=root, video_backend="pyav")
    assert ds.meta.total_episodes == 4 and len(ds) == 28 and ds.fps == 10
    feats = ds.meta.features
    for k in ("observation.state", "observation.images.front", "observation.images.wrist", "action",
              "next.reward", "next.terminated", "next.truncated", "next.success", "intervened",
              "is_last", "policy_version", "actor_id", "actor_episode", "actor_seq"):
        assert k in feats, k
    assert feats["observation.images.front"]["dtype"] == ("video" if video else "image")
    item = ds[7 + 3]  # episode 1, step 3
    assert int(item["episode_index"]) == 1 and int(item["frame_index"]) == 3
    assert item["actor_id"] == "a0" and item["task"] == "task 1"
    assert int(item["policy_version"]) == 1 and int(item["actor_seq"]) == 10
    assert float(item["observation.state"][0]) == 1003.0
    img = (item["observation.images.front"] * 255).round()  # lerobot: float CHW in [0, 1]
    assert abs(float(img[0, 16, 16]) - pixel(1, 3)) <= (12 if video else 0)
    # terminated and truncated apart: episode 0 terminates, episode 1 is truncated
    term = [bool(ds[i]["next.terminated"]) for i in range(14)]
    trunc = [bool(ds[i]["next.truncated"]) for i in range(14)]
    assert term == [False] * 5 + [True] + [False] * 8
    assert trunc == [False] * 12 + [True] + [False]


def test_resume_refills_newest_episodes_up_to_capacity_decoding_video_once(tmp_path):
    root = tmp_path / "dataset"
    write_episodes(root, 5, video=True)
    rb = ReplayBuffer(22, SPEC)  # room for the 3 newest episodes of 7 records
    store = EpisodeStore(root, SPEC, video=True, fps=10)
    assert store.load_into(rb) == 21
    assert rb.restored == 21 and rb.total_added == 0 and len(rb) == 18
    shutil.rmtree(root)  # sampling never reads the disk again
    s = rb.sample(300)
    assert set(s["episode"].tolist()) == {2, 3, 4}
    st = s["observation.state"][:, 0].numpy()
    assert (s["next.observation.state"][:, 0].numpy() == st + 1).all()
    ep, step = s["episode"].numpy(), s["step"].numpy()
    want = (7 * step + 13 * ep) % 256
    assert np.abs(s["observation.images.front"][:, 0, 0, 0].numpy().astype(int) - want).max() <= 12
    # the success view works on refilled episodes too (episodes 2 and 4 succeeded)
    from data.sampler import SuccessView

    assert set(SuccessView(rb, include_interventions=False).sample(50)["episode"].tolist()) == {2, 4}


def test_build_replay_recovers_refills_and_writes(tmp_path):
    write_episodes(tmp_path / "run" / "dataset", 2, video=False)
    cfg = {"capacity": 100, "persist": True, "video": False, "refill": True, "image_codec": "raw"}
    rep = build_replay(cfg, SPEC, run_dir=tmp_path / "run")
    try:
        assert len(rep.buffer) == 12 and rep.status()["dataset_episodes"] == 2
        assert rep.sampler is rep.buffer
        rep.store.submit(Episode.from_batch(episode_batch("a1", 0, 0, 3)))
        assert rep.store.flush(60) and rep.status()["dataset_episodes"] == 3
    finally:
        rep.close()
    assert build_replay(cfg, SPEC, run_dir=tmp_path / "run", train=False).store is None


def test_reopening_removes_temp_files_of_an_interrupted_atomic_write(tmp_path):
    """A kill inside atomic_write leaves ``.<name>.tmp`` beside the commit record or a meta
    file; the next open removes them and keeps every committed episode."""
    root = tmp_path / "dataset"
    write_episodes(root, 3, video=False)
    stale = [root / ".tandem" / ".commit.json.tmp", root / "meta" / ".info.json.tmp"]
    for p in stale:
        p.write_bytes(b"{half a rec")
    store = EpisodeStore(root, SPEC, video=False, fps=10)
    assert store.recovered_files == 2 and store.total_episodes == 3
    assert not any(p.exists() for p in stale)
    assert json.loads((root / "meta" / "info.json").read_text())["total_episodes"] == 3


def test_another_spec_or_a_foreign_dataset_is_a_clear_error(tmp_path):
    root = tmp_path / "dataset"
    write_episodes(root, 1, video=False)
    other = EnvSpec(state_dim=4, action_dim=2, cameras=dict(SPEC.cameras))
    with pytest.raises(StoreError, match="another env spec"):
        EpisodeStore(root, other, video=False)
    with pytest.raises(StoreError, match="another env spec"):
        EpisodeStore(root, SPEC, video=True)
    shutil.rmtree(root / ".tandem")
    with pytest.raises(StoreError, match="did not write"):
        EpisodeStore(root, SPEC, video=False)


XSPEC = SPEC.with_extras({"log_prob": ("float32", ()), "noise": ("float32", (2, 3))})


def extras_episode(actor: str, first_seq: int, e: int, length: int):
    """An episode whose records carry policy extras and non-default chunk / group columns."""
    recs = episode_records(e, length, spec=XSPEC, policy_version=e, task=f"task {e}")
    for t, r in enumerate(recs):
        r["extra.log_prob"] = np.float32(-0.125 * t - e)
        r["extra.noise"] = (np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5 + 100 * e + t)
        r["chunk_start"] = t % 3 == 0
        r["chunk_index"] = t % 3
        r["group_id"] = 40 + e
    return Episode.from_batch(batch(actor, first_seq, recs))


def test_extras_and_chunk_columns_round_trip(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from data.store import read_episodes, tandem_batch

    root = tmp_path / "dataset"
    store = EpisodeStore(root, XSPEC, video=False, fps=10)
    eps = [extras_episode("a0", 0, 0, 4), extras_episode("a0", 5, 1, 5)]
    done, dropped = store.write(eps)
    assert len(done) == 2 and not dropped and store.total_frames == 11
    ds = LeRobotDataset("tandem/replay", root=root, video_backend="pyav")
    feats = ds.meta.features
    assert feats["extra.log_prob"]["dtype"] == "float32"
    assert tuple(feats["extra.log_prob"]["shape"]) == (1,)
    assert tuple(feats["extra.noise"]["shape"]) == (2, 3)
    for k, dt in (("chunk_start", "bool"), ("chunk_index", "int64"), ("group_id", "int64")):
        assert feats[k]["dtype"] == dt and tuple(feats[k]["shape"]) == (1,)
    i = 0
    for ep in eps:  # lerobot's own loader
        a = ep.arrays
        for t in range(len(ep)):
            item = ds[i]
            assert int(item["episode_index"]) == ep.episode and int(item["frame_index"]) == t
            assert item["extra.log_prob"].numel() == 1  # a (1,) feature: lerobot gives a scalar
            assert float(item["extra.log_prob"]) == float(a["extra.log_prob"][t])
            assert item["extra.noise"].shape == (2, 3)
            assert np.array_equal(item["extra.noise"].numpy(), a["extra.noise"][t])
            assert bool(item["chunk_start"]) == bool(a["chunk_start"][t])
            assert int(item["chunk_index"]) == int(a["chunk_index"][t])
            assert int(item["group_id"]) == int(a["group_id"][t])
            i += 1
    assert i == len(ds)
    got = [tandem_batch(e, XSPEC) for e in read_episodes(root)]  # Tandem's reader
    assert len(got) == 2
    for b, ep in zip(got, eps):
        assert b.actor_id == "a0" and b.first_seq == ep.first_seq
        for k in ("extra.log_prob", "extra.noise", "chunk_start", "chunk_index", "group_id",
                  "observation.state", "action", "reward", "episode", "step", "is_last",
                  "policy_version", "observation.images.front"):
            want = ep.arrays[k]
            assert b.arrays[k].dtype == want.dtype and b.arrays[k].shape == want.shape, k
            assert np.array_equal(b.arrays[k], want), k
    assert got[1].arrays["extra.noise"].shape == (6, 2, 3)
    assert got[1].arrays["extra.log_prob"].shape == (6,)
    # a reopened store refills a buffer from it
    store2 = EpisodeStore(root, XSPEC, video=False, fps=10)
    assert store2.total_episodes == 2 and store2.acked == {"a0": 10}


def test_episode_without_a_declared_extra_is_dropped_not_written(tmp_path):
    store = EpisodeStore(tmp_path / "dataset", XSPEC, video=False, fps=10)
    good = extras_episode("a0", 0, 0, 3)
    bad = Episode.from_batch(episode_batch("a0", 4, 1, 3, spec=XSPEC))  # no extras
    done, dropped = store.write([good, bad])
    assert done == [good] and dropped == [bad]
    assert store.total_episodes == 1 and store.counters["dropped_episodes"] == 1


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_dataset_from_before_the_extras_is_refused_naming_them_and_kept(tmp_path):
    root = tmp_path / "dataset"
    write_episodes(root, 2, video=False)  # no extras declared then
    before = _snapshot(root)
    with pytest.raises(StoreError) as err:
        EpisodeStore(root, XSPEC, video=False)
    msg = str(err.value)
    assert "extra.log_prob" in msg and "extra.noise" in msg and "missing" in msg
    assert _snapshot(root) == before  # nothing lost, nothing changed
    assert EpisodeStore(root, SPEC, video=False).total_episodes == 2
    # and the other way round: a dataset with extras, opened without them
    xroot = tmp_path / "x"
    EpisodeStore(xroot, XSPEC, video=False).write([extras_episode("a0", 0, 0, 3)])
    xbefore = _snapshot(xroot)
    with pytest.raises(StoreError, match=r"unexpected features \['extra.log_prob', 'extra.noise'\]"):
        EpisodeStore(xroot, SPEC, video=False)
    assert _snapshot(xroot) == xbefore


def plain_lerobot_dataset(root: Path, n_eps: int, length: int):
    """A dataset recorded with lerobot alone (gym_manipulator-like columns)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    feats = {"observation.state": {"dtype": "float32", "shape": (3,), "names": None},
             "observation.images.front": {"dtype": "video", "shape": (32, 32, 3),
                                          "names": ["height", "width", "channels"]},
             "observation.images.wrist": {"dtype": "image", "shape": (32, 32, 3),
                                          "names": ["height", "width", "channels"]},
             "action": {"dtype": "float32", "shape": (2,), "names": None},
             "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
             "next.done": {"dtype": "bool", "shape": (1,), "names": None}}
    ds = LeRobotDataset.create("someone/demos", fps=10, features=feats, root=root,
                               video_backend="pyav")
    for e in range(n_eps):
        for t in range(length):
            ds.add_frame({"observation.state": np.array([1000 * e + t, t, -t], np.float32),
                          "observation.images.front": np.full((32, 32, 3), pixel(e, t), np.uint8),
                          "observation.images.wrist": np.full((32, 32, 3), pixel(e, t), np.uint8),
                          "action": np.array([t, -t], np.float32),
                          "next.reward": np.array([float(t == length - 1)], np.float32),
                          "next.done": np.array([t == length - 1]), "task": "stack"})
        ds.save_episode(parallel_encoding=False)
    ds.finalize()


def test_any_lerobot_dataset_loads_as_demos_and_mixes_50_50(tmp_path):
    from data.demos import load_demos

    plain_lerobot_dataset(tmp_path / "demos", 3, 8)
    demo = load_demos(tmp_path / "demos", SPEC)
    assert len(demo) == 3 * 8  # every frame a transition; the last one onto itself, terminated
    s = demo.sample(400)
    step = s["step"].numpy()
    assert (s["terminated"].numpy() == (step == 7)).all() and not s["truncated"].any()
    assert (s["reward"].numpy() == (step == 7)).all()
    assert (s["policy_version"] == -1).all() and set(s["task"]) == {"stack"}
    last = step == 7
    assert torch.equal(s["next.observation.state"][last], s["observation.state"][last])
    inner = ~last
    assert (s["next.observation.state"][inner, 0] == s["observation.state"][inner, 0] + 1).all()
    assert np.abs(s["observation.images.front"][:, 0, 0, 0].numpy().astype(int)
                  - (7 * step + 13 * s["episode"].numpy()) % 256).max() <= 12
    online = ReplayBuffer(100, SPEC)
    online.add(episode_batch("a0", 0, 50, 10))
    mix = MixedSampler(online, demo)
    b = mix.sample(256)
    assert int(b["is_demo"].sum()) == 128
    check_successor({k: (v[~b["is_demo"]] if isinstance(v, torch.Tensor) else v)
                     for k, v in b.items() if k != "task"})
    # Tandem's own datasets load as demos exactly, final observations included
    write_episodes(tmp_path / "own", 2, video=False)
    own = load_demos(tmp_path / "own", SPEC)
    assert len(own) == 12
    check_successor(own.sample(100))


def test_view_episode_saves_an_rrd_headless(tmp_path):
    root = tmp_path / "dataset"
    write_episodes(root, 2, video=True)
    out = tmp_path / "ep.rrd"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "view_episode.py"), str(root),
                        "--episode", "-1", "--save", str(out)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "episode 1: 7 frames" in r.stdout and out.stat().st_size > 0
    rerun = Path(sys.executable).with_name("rerun")
    if rerun.exists():
        p = subprocess.run([str(rerun), "rrd", "print", str(out)], capture_output=True, text=True,
                           timeout=120, env={**env, "RERUN_ANALYTICS": "0"})
        for entity in ("/cameras/front", "/cameras/wrist", "/action/0", "/action/1", "/reward",
                       "/flags/intervened", "/flags/terminated", "/flags/truncated"):
            assert entity in p.stdout, entity


@pytest.mark.slow
def test_bench_buffer_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.bench.buffer", "--json",
                        "--episodes", "3", "--episode-len", "20", "--sample-iters", "2",
                        "--write-episodes", "1", "--writer-episodes", "4", "--writer-len", "8"],
                       capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("memory_ratio", "sample_ratio", "add_ratio"):
        assert res[k] > 0
    assert res["memory_ratio"] < 0.3  # uint8 against lerobot's float32 images (both keep one copy): ~1/4
    assert res["tandem"]["write_episodes_per_s"] > 0
    assert res["writer_ratio"] > 0 and res["writer"]["pool"]["episodes"] == 4


def test_a_dataset_without_cameras_is_appended_by_tandem_not_by_lerobots_save_episode(
        tmp_path, monkeypatch):
    """Without cameras ``video`` changes nothing in the dataset, and lerobot's save_episode
    (0.3-1 s an episode even without images) fell behind two reacher actors in tools/bench/soak.py:
    the episodes waiting for it grew the learner's memory, their unacknowledged records the
    actors'. The rows are appended as for video datasets, stats on the writer thread."""
    from lerobot.datasets.dataset_writer import DatasetWriter
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from data.store import read_episodes, tandem_batch
    from test_buffer_helpers import STATE_ONLY

    def refuse(*a, **k):
        raise AssertionError("lerobot's save_episode was called")

    monkeypatch.setattr(DatasetWriter, "save_episode", refuse)
    root = tmp_path / "dataset"
    store = write_episodes(root, 3, video=False, spec=STATE_ONLY)
    assert store.total_episodes == 3 and store.prepared == {"inline": 3}
    assert store._pool.workers == 0  # nothing to encode: no worker processes
    ds = LeRobotDataset("tandem/replay", root=root, video_backend="pyav")
    assert ds.meta.total_episodes == 3 and len(ds) == 21 and not ds.meta.video_keys
    item = ds[7 + 3]  # episode 1, step 3
    assert int(item["episode_index"]) == 1 and int(item["frame_index"]) == 3
    assert float(item["observation.state"][0]) == 1003.0 and item["task"] == "task 1"
    got = [tandem_batch(e, STATE_ONLY) for e in read_episodes(root)]
    assert [b.first_seq for b in got] == [0, 7, 14]
    assert np.array_equal(got[2].arrays["observation.state"][:, 0], 2000 + np.arange(7))
    reopened = EpisodeStore(root, STATE_ONLY, video=False, fps=10)
    assert reopened.total_episodes == 3 and reopened.acked == {"a0": 20}
