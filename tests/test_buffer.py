"""The in-memory replay ring (data/replay.py) and the samplers over it (data/sampler.py)."""

import threading
import time

import numpy as np
import pytest
import torch

from data.replay import ReplayBuffer
from data.sampler import MixedSampler, PolicyVersionView, SuccessView
from test_buffer_helpers import SPEC, check_successor, episode_batch, episode_records, batch


@pytest.mark.parametrize("codec", ["raw", "zlib", "lz4"])
def test_uint8_images_next_obs_by_index(codec):
    if codec == "lz4":
        pytest.importorskip("lz4")
    rb = ReplayBuffer(64, SPEC, image_codec=codec)
    rb.add(episode_batch("a0", 0, 0, 5))
    assert rb.num_records == 6 and len(rb) == 5  # the is_last record is not a transition
    s = rb.sample(200)
    check_successor(s)
    for k in SPEC.image_keys:
        assert s[k].dtype == torch.uint8 and s[k].shape == (200, 32, 32, 3)
        assert s["next." + k].dtype == torch.uint8
    assert s["observation.state"].dtype == torch.float32
    assert s["policy_version"].dtype == torch.int64 and s["episode"].dtype == torch.int64
    assert s["task"] == ["reach"] * 200
    if codec == "raw":
        # every observation is stored once: no next-observation copy
        img_bytes = 64 * 32 * 32 * 3 * len(SPEC.image_keys)
        assert img_bytes <= rb.nbytes < img_bytes + 64 * 100
        for k in SPEC.image_keys:
            assert rb._images[k].data.dtype == np.uint8


@pytest.mark.parametrize("codec", ["zlib", "lz4"])
@pytest.mark.parametrize("content", ["smooth", "noise"])
def test_compressed_codecs_are_lossless(codec, content):
    if codec == "lz4":
        pytest.importorskip("lz4")
    rng = np.random.default_rng(0)
    raw, z = ReplayBuffer(40, SPEC, seed=3), ReplayBuffer(40, SPEC, seed=3, image_codec=codec)
    recs = episode_records(0, 30)
    for r in recs:
        for k in SPEC.image_keys:
            r[k] = ((np.add.outer(np.arange(32), np.arange(32))[..., None] * 4
                     + rng.integers(0, 3, (32, 32, 3))).astype(np.uint8) if content == "smooth"
                    else rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    for rb in (raw, z):
        rb.add(batch("a0", 0, recs))
    a, b = raw.sample(50), z.sample(50)
    for k in a:
        if k != "task":
            assert torch.equal(a[k], b[k]), k
    if content == "smooth":
        assert z.nbytes < raw.nbytes


def test_terminated_and_truncated_kept_apart():
    rb = ReplayBuffer(64, SPEC)
    rb.add(episode_batch("a0", 0, 0, 3, terminated=True))
    rb.add(episode_batch("a0", 4, 1, 3, terminated=False))
    s = rb.sample(500)
    step = s["step"].numpy()
    ep = s["episode"].numpy()
    term, trunc = s["terminated"].numpy(), s["truncated"].numpy()
    assert (term == ((step == 2) & (ep == 0))).all()
    assert (trunc == ((step == 2) & (ep == 1))).all()
    assert not (term & trunc).any()


def test_capacity_bound_and_wraparound_keep_successors_valid():
    rb = ReplayBuffer(50, SPEC)
    seq = 0
    for ep in range(12):  # 12 x 11 records through 50 slots
        b = episode_batch("a0", seq, ep, 10)
        rb.add(b)
        seq += len(b)
        assert rb.num_records <= 50
        check_successor(rb.sample(100))
    assert rb.num_records == 50 and rb.total_added == 132
    # interleaved actors, batches split mid-episode
    for actor in ("b", "c"):
        recs = episode_records(20 if actor == "b" else 30, 40)
        for i in range(0, len(recs), 7):
            rb.add(batch(actor, i, recs[i:i + 7]))
            check_successor(rb.sample(64))


def test_add_and_sample_run_concurrently():
    rb = ReplayBuffer(300, SPEC, image_codec="raw")
    rb.add(episode_batch("a0", 0, 0, 5))
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer():
        seq, ep = 6, 1
        try:
            while not stop.is_set():
                recs = episode_records(ep, 17)
                for i in range(0, len(recs), 5):
                    rb.add(batch("a0", seq + i, recs[i:i + 5]))
                seq += len(recs)
                ep += 1
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def reader():
        try:
            while not stop.is_set():
                check_successor(rb.sample(64))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader),
               threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors[0]
    assert rb.total_added > 300  # it wrapped while being sampled


def test_success_view_holds_successful_episodes_and_interventions():
    rb = ReplayBuffer(200, SPEC)
    rb.add(episode_batch("a0", 0, 0, 6, success=True))
    rb.add(episode_batch("a0", 7, 1, 6, success=False, intervened_steps=(2, 3)))
    rb.add(episode_batch("a0", 14, 2, 6, success=False))
    view = SuccessView(rb)
    assert len(view) == 6 + 2
    s = view.sample(300)
    ep, step = s["episode"].numpy(), s["step"].numpy()
    assert set(ep.tolist()) == {0, 1}
    assert set(step[ep == 1].tolist()) == {2, 3}
    assert len(SuccessView(rb, include_interventions=False)) == 6
    # an unfinished episode has no outcome yet: not in the view
    rb.add(batch("a1", 0, episode_records(5, 6, success=True)[:4]))
    assert len(view) == 8


def test_policy_version_view_keeps_recent_versions():
    rb = ReplayBuffer(200, SPEC)
    for v in range(5):
        rb.add(episode_batch("a0", v * 5, v, 4, policy_version=v))
    current = {"v": 4}
    view = PolicyVersionView(rb, lambda: current["v"], max_lag=1)
    assert len(view) == 8
    assert set(view.sample(100)["policy_version"].tolist()) == {3, 4}
    current["v"] = 10
    assert len(view) == 0
    with pytest.raises(ValueError, match="passes the filter"):
        view.sample(4)


def test_mixed_sampler_draws_the_configured_ratio():
    online, demo = ReplayBuffer(100, SPEC, seed=1), ReplayBuffer(100, SPEC, seed=2)
    demo.add(episode_batch("demo", 0, 7, 10, policy_version=-1))
    mix = MixedSampler(online, demo)  # RLPD 50/50 by default
    s = mix.sample(64)  # online empty: all demo
    assert s["is_demo"].all()
    online.add(episode_batch("a0", 0, 1, 10))
    s = mix.sample(64)
    assert int(s["is_demo"].sum()) == 32
    assert (s["episode"][s["is_demo"]] == 7).all() and (s["episode"][~s["is_demo"]] == 1).all()
    check_successor(s)
    assert MixedSampler(online, demo, demo_ratio=0.25).split(64) == (48, 16)
    assert len(mix) == 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_samples_are_pinned_and_copied_to_the_gpu():
    rb = ReplayBuffer(64, SPEC, device="cuda")
    assert rb.pin_memory
    rb.add(episode_batch("a0", 0, 0, 20))
    s = rb.sample(32)
    assert all(v.is_cuda for k, v in s.items() if k != "task")
    torch.cuda.synchronize()
    check_successor({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
