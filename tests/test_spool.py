"""The actor's spool recycles acknowledged files (renamed to spares, overwritten by later
appends) without changing what is pending, what is read back or what a restart sees."""

from __future__ import annotations

import numpy as np

from actor.spool import SPARE_SUFFIX, Spool
from data.core.codec import decode
from data.core.transitions import TransitionBatch
from tools.bench.common import bench_spec, episode_flags, random_images


def _batch(spec, seq: int, n: int, episode: int) -> TransitionBatch:
    rng = np.random.default_rng(seq)
    arrays = {"observation.state": rng.standard_normal((n, spec.state_dim), dtype=np.float32),
              **random_images(rng, spec.cameras, n),
              "action": rng.uniform(-1, 1, (n, spec.action_dim)).astype(np.float32),
              "reward": rng.standard_normal(n, dtype=np.float32), **episode_flags(n, episode)}
    return TransitionBatch("a0", seq, arrays, [""] * n)


def test_acked_files_become_spares_that_later_appends_overwrite(tmp_path):
    spec = bench_spec(4, 2, ["front"], 16)
    spool = Spool(tmp_path, fsync=False, cache_bytes=0)  # reads come from the files
    big = _batch(spec, 0, 8, 0)
    spool.append(big)
    spool.ack(big.last_seq)
    assert not list(tmp_path.glob("*.msg")) and len(list(tmp_path.glob("*" + SPARE_SUFFIX))) == 1
    small = _batch(spec, 8, 3, 1)  # shorter than the spare it overwrites
    spool.append(small)
    assert not list(tmp_path.glob("*" + SPARE_SUFFIX)), "the spare was not reused"
    (key,) = spool.pending()
    msg = decode(spool.read(key))
    assert msg["first_seq"] == 8 and msg["last_seq"] == 10
    for k, v in small.arrays.items():
        np.testing.assert_array_equal(msg.arrays[k], v)
    # a restart sees the pending batch, not the spares
    spool.ack(7)  # nothing new
    other = _batch(spec, 11, 2, 2)
    spool.append(other)
    spool.ack(10)
    assert list(tmp_path.glob("*" + SPARE_SUFFIX))
    again = Spool(tmp_path, fsync=False)
    assert again.pending() == [(11, 12)] and len(again) == 2 and again.next_seq == 13
    assert not list(tmp_path.glob("*" + SPARE_SUFFIX)), "spares of a killed actor are deleted"


def test_spares_are_bounded(tmp_path):
    spec = bench_spec(4, 2, ["front"], 16)
    b0 = _batch(spec, 0, 4, 0)
    spool = Spool(tmp_path, fsync=False, spare_bytes=0)
    spool.append(b0)
    spool.ack(b0.last_seq)
    assert not list(tmp_path.iterdir()) or [p.name for p in tmp_path.iterdir()] == ["meta.json"]
