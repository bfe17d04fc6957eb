"""Action-chunk windows of the replay ring (``sample(n, horizon=H)``), the new record columns
(chunk_start, chunk_index, group_id) and policy extras stored per slot."""

import numpy as np
import pytest
import torch

from data.core.spec import EnvSpec
from data.replay import ReplayBuffer
from test_buffer_helpers import SPEC, STATE_ONLY, batch, check_successor, episode_records, pixel


def check_windows(s: dict, horizon: int, eps: dict, spec: EnvSpec = SPEC) -> np.ndarray:
    """Every row is a window of real consecutive steps of one episode (``eps``: episode ->
    (length, terminated)) starting at its ``step``; returns the start steps."""
    st = s["observation.state"][:, 0].numpy().astype(np.int64)
    ep, t = st // 1000, st % 1000
    length = np.array([eps[e][0] for e in ep.tolist()], np.int64)
    term = np.array([eps[e][1] for e in ep.tolist()], bool)
    k = np.minimum(horizon, length - t)
    assert (k >= 1).all()
    assert s["n_steps"].dtype == torch.int64 and (s["n_steps"].numpy() == k).all()
    i = np.arange(horizon)[None]
    mask = i < k[:, None]
    assert s["step_mask"].dtype == torch.bool and (s["step_mask"].numpy() == mask).all()
    steps = t[:, None] + np.minimum(i, k[:, None] - 1)  # padded with the last real step
    assert s["action"].shape == (len(t), horizon, spec.action_dim)
    assert (s["action"].numpy() == np.stack([steps, -steps], -1)).all()
    assert s["reward"].shape == (len(t), horizon)
    assert (s["reward"].numpy() == np.where(mask, (t[:, None] + i) * 0.5, 0.0)).all()
    end = t + k == length
    assert (s["terminated"].numpy() == (end & term)).all()
    assert (s["truncated"].numpy() == (end & ~term)).all()
    nst = s["next.observation.state"].numpy()
    assert (nst[:, 0] == st + k).all() and (nst[:, 1] == nst[:, 0] % 1000).all()
    assert (s["episode"].numpy() == ep).all() and (s["step"].numpy() == t).all()
    for key in spec.image_keys:
        assert (s[key][:, 0, 0, 0].numpy() == pixel(ep, t)).all()
        assert (s["next." + key][:, 0, 0, 0].numpy() == pixel(ep, t + k)).all()
    return t


@pytest.mark.parametrize("codec", ["raw", "zlib"])
def test_windows_inside_an_episode(codec):
    rb = ReplayBuffer(200, SPEC, image_codec=codec, seed=1)
    rb.add(batch("a0", 0, episode_records(3, 20)))
    s = rb.sample(400, horizon=4)
    t = check_windows(s, 4, {3: (20, False)})
    assert set(t.tolist()) == set(range(20))
    full = t <= 16
    assert s["step_mask"][full].all()
    assert (s["truncated"][full].numpy() == (t[full] == 16)).all()  # its 4th step is the end
    assert (s["next.observation.state"][full, 0] == s["observation.state"][full, 0] + 4).all()
    assert rb.count(horizon=4) == 20 == len(rb)


@pytest.mark.parametrize("terminated", [True, False])
def test_windows_cut_by_the_episode_end(terminated):
    rb = ReplayBuffer(100, SPEC, seed=2)
    rb.add(batch("a0", 0, episode_records(1, 5, terminated=terminated)))
    s = rb.sample(300, horizon=4)
    t = check_windows(s, 4, {1: (5, terminated)})
    assert set(t.tolist()) == set(range(5))
    cut = t >= 1  # windows that reach the episode's end (step 4)
    flag, other = ("terminated", "truncated") if terminated else ("truncated", "terminated")
    assert s[flag][cut].all() and not s[flag][~cut].any() and not s[other].any()
    # the next observation of a cut window is the episode's final (is_last) observation
    assert (s["next.observation.state"][cut, 0] == 1005).all()
    assert (s["next.observation.images.front"][cut, 0, 0, 0] == pixel(1, 5)).all()
    row = int(np.flatnonzero(t == 3)[0])  # 2 real steps, then padding
    assert s["step_mask"][row].tolist() == [True, True, False, False]
    assert s["action"][row, :, 0].tolist() == [3, 4, 4, 4]
    assert s["reward"][row].tolist() == [1.5, 2.0, 0.0, 0.0]


def test_horizon_one_keeps_the_transition_layout_and_new_columns():
    rb = ReplayBuffer(64, SPEC)
    recs = episode_records(0, 6)
    for r in recs:
        r.update(chunk_start=r["step"] % 3 == 0, chunk_index=r["step"] % 3, group_id=7)
    rb.add(batch("a0", 0, recs))
    s = rb.sample(50)
    check_successor(s)
    assert s["action"].shape == (50, 2) and s["reward"].shape == (50,)
    assert "step_mask" not in s and "n_steps" not in s
    assert s["chunk_start"].dtype == torch.bool
    assert s["chunk_index"].dtype == torch.int64 and s["group_id"].dtype == torch.int64
    step = s["step"].numpy()
    assert (s["chunk_index"].numpy() == step % 3).all()
    assert (s["chunk_start"].numpy() == (step % 3 == 0)).all() and (s["group_id"] == 7).all()
    w = rb.sample(50, horizon=3)  # per-record fields come from the window's first step
    assert (w["chunk_index"].numpy() == w["step"].numpy() % 3).all()
    rb.add(batch("a0", 7, episode_records(1, 3)))  # columns left out take their defaults
    s = rb.sample(200)
    first = s["episode"] == 1
    assert s["chunk_start"][first].all() and (s["chunk_index"][first] == 0).all()
    assert (s["group_id"][first] == -1).all()


def test_open_episodes_only_yield_windows_that_arrived():
    rb = ReplayBuffer(100, SPEC, seed=3)
    recs = episode_records(4, 12)
    rb.add(batch("a0", 0, recs[:3]))  # steps 0-2 arrived: transitions 0 and 1
    assert len(rb) == 2 and rb.count(horizon=4) == 0
    with pytest.raises(ValueError, match="horizon 4"):
        rb.sample(8, horizon=4)
    got = 3
    for n in (2, 4, 2):
        rb.add(batch("a0", got, recs[got:got + n]))
        got += n
        t = check_windows(rb.sample(300, horizon=4), 4, {4: (12, False)})
        # step t + 3 must have a successor, i.e. step t + 4 arrived
        assert t.max() + 4 <= got - 1 and set(t.tolist()) == set(range(got - 4))
        assert rb.count(horizon=4) == got - 4
    rb.add(batch("a0", got, recs[got:]))  # the end arrives: every start is available
    assert set(check_windows(rb.sample(400, horizon=4), 4, {4: (12, False)})) == set(range(12))
    # an abandoned episode's last records never complete a window
    rb.add(batch("a1", 0, episode_records(5, 9)[:6]))
    rb.abandon("a1", 5)
    s = rb.sample(600, horizon=3)
    check_windows(s, 3, {4: (12, False), 5: (9, False)})
    assert set(s["step"][s["episode"] == 5].tolist()) == {0, 1, 2}


def test_interleaved_actors_with_the_same_episode_id():
    rb = ReplayBuffer(300, SPEC, seed=4)
    streams = {}
    for a, length in (("a", 9), ("b", 9), ("c", 9)):
        recs = episode_records(0, length)
        for r in recs:  # tell the actors apart: state[1] = 100 * actor + step
            r["observation.state"][1] = 100 * "abc".index(a) + r["step"]
        streams[a] = recs
    pos = dict.fromkeys(streams, 0)
    while any(pos[a] < len(streams[a]) for a in streams):
        for a in streams:
            if pos[a] < len(streams[a]):
                rb.add(batch(a, pos[a], streams[a][pos[a]:pos[a] + 2]))
                pos[a] += 2
    s = rb.sample(500, horizon=5)
    # the state[1] check in check_windows is about step; here the actor tag must also hold
    st1, nst1 = s["observation.state"][:, 1].numpy(), s["next.observation.state"][:, 1].numpy()
    assert ((nst1 - st1) == s["n_steps"].numpy()).all()
    assert ((st1 // 100) == (nst1 // 100)).all() and len(set((st1 // 100).tolist())) == 3
    assert rb.count(horizon=5) == 27


@pytest.mark.parametrize("codec", ["raw", "zlib"])
def test_ring_overwrite_never_yields_a_stale_window(codec):
    rng = np.random.default_rng(5)
    rb = ReplayBuffer(37, SPEC, image_codec=codec, seed=6)
    eps, seq, open_recs, next_ep = {}, {}, {}, 0
    for it in range(500):  # a2 is slow: its open episodes outlive their oldest records
        a = f"a{rng.choice(3, p=[0.6, 0.35, 0.05])}"
        if not open_recs.get(a):
            length, term = int(rng.integers(1, 14)), bool(rng.integers(2))
            eps[next_ep] = (length, term)
            open_recs[a] = episode_records(next_ep, length, terminated=term)
            next_ep += 1
        n = int(rng.integers(1, 6))
        part, open_recs[a] = open_recs[a][:n], open_recs[a][n:]
        rb.add(batch(a, seq.get(a, 0), part))
        seq[a] = seq.get(a, 0) + len(part)
        for h in (2, 5):
            if rb.count(horizon=h):
                check_windows(rb.sample(64, horizon=h), h, eps)
    assert rb.total_added > 10 * rb.capacity
    # an episode whose newest stored record is overwritten before its successor arrives
    eps.update({900: (20, False), 901: (40, True)})
    slow, fast = episode_records(900, 20), episode_records(901, 40, terminated=True)
    rb.add(batch("slow", 0, slow[:3]))
    rb.add(batch("fast", 0, fast))
    rb.add(batch("slow", 3, slow[3:]))
    s = rb.sample(500, horizon=4)
    check_windows(s, 4, eps)
    assert set(s["step"][s["episode"] == 900].tolist()) == set(range(3, 20))


def test_sampling_is_uniform_over_available_windows_even_when_most_are_not():
    rb = ReplayBuffer(400, STATE_ONLY, seed=7)
    rb.add(batch("a0", 0, episode_records(0, 10, spec=STATE_ONLY)))
    rb.add(batch("a1", 0, episode_records(1, 80, spec=STATE_ONLY)[:60]))  # open
    s = rb.sample(4000, horizon=30)  # 10 + 30 of 69 starts available
    t = check_windows(s, 30, {0: (10, False), 1: (80, False)}, spec=STATE_ONLY)
    ep = s["episode"].numpy()
    counts = np.bincount(ep * 100 + t, minlength=200)
    want = np.r_[np.ones(10), np.zeros(90), np.ones(30), np.zeros(70)].astype(bool)
    assert (counts[~want] == 0).all()
    assert counts[want].min() > 50 and counts[want].max() < 160  # 100 expected each
    rb2 = ReplayBuffer(400, STATE_ONLY, seed=8)
    rb2.add(batch("a0", 0, episode_records(0, 2, spec=STATE_ONLY)))
    rb2.add(batch("a1", 0, episode_records(1, 200, spec=STATE_ONLY)[:120]))
    s = rb2.sample(300, horizon=130)  # 2 of 121 starts: the exact pass fills the batch
    assert set(s["episode"].tolist()) == {0} and set(s["step"].tolist()) == {0, 1}


def test_where_filter_admits_windows_by_their_first_step():
    rb = ReplayBuffer(200, SPEC, seed=9)
    rb.add(batch("a0", 0, episode_records(0, 8, success=True)))
    rb.add(batch("a0", 9, episode_records(1, 8)))
    s = rb.sample(200, where=lambda b: b.episode_success, horizon=3)
    check_windows(s, 3, {0: (8, False), 1: (8, False)})
    assert set(s["episode"].tolist()) == {0}
    assert rb.count(lambda b: b.episode_success, horizon=3) == 8
    with pytest.raises(ValueError, match="horizon"):
        rb.sample(4, horizon=0)


EXTRAS = {"log_prob": ("float32", ()), "noise": ("float32", (3, 2)),
          "tokens": ("int64", (4,)), "kept": ("bool", ()), "slot": ("int32", (2,))}


def _with_extras(recs):
    for r in recs:
        g = 1000 * r["episode"] + r["step"]
        r["extra.log_prob"] = np.float32(-g)
        r["extra.noise"] = np.arange(6, dtype=np.float32).reshape(3, 2) + g
        r["extra.tokens"] = np.arange(4, dtype=np.int64) * g
        r["extra.kept"] = bool(g % 2)
        r["extra.slot"] = np.array([g, -g], np.int32)
    return recs


@pytest.mark.parametrize("horizon", [1, 3])
def test_extras_columns_round_trip(horizon):
    spec = SPEC.with_extras(EXTRAS)
    rb = ReplayBuffer(50, spec, seed=10)
    rb.add(batch("a0", 0, _with_extras(episode_records(2, 12))))
    s = rb.sample(100, horizon=horizon)
    g = s["observation.state"][:, 0].numpy().astype(np.int64)
    assert spec.extra_keys == sorted(k for k in s if k.startswith("extra."))
    assert s["extra.log_prob"].dtype == torch.float32 and s["extra.log_prob"].shape == (100,)
    assert (s["extra.log_prob"].numpy() == -g).all()
    assert s["extra.noise"].shape == (100, 3, 2)
    assert (s["extra.noise"].numpy() == np.arange(6).reshape(3, 2) + g[:, None, None]).all()
    assert s["extra.tokens"].dtype == torch.int64
    assert (s["extra.tokens"].numpy() == np.arange(4) * g[:, None]).all()
    assert s["extra.kept"].dtype == torch.bool and (s["extra.kept"].numpy() == g % 2).all()
    assert s["extra.slot"].dtype == torch.int32
    assert (s["extra.slot"].numpy() == np.stack([g, -g], 1)).all()
    # memory accounting counts the extras' columns
    per_slot = 4 + 6 * 4 + 4 * 8 + 1 + 2 * 4
    assert rb.nbytes - ReplayBuffer(50, SPEC).nbytes == 50 * per_slot
    # records without the extras (demos, older data) store zeros
    rb.add(batch("demo", 0, episode_records(3, 49)))  # overwrites all
    s = rb.sample(100, horizon=horizon)
    assert (s["episode"] == 3).all()
    for k in spec.extra_keys:
        assert not s[k].any(), k
