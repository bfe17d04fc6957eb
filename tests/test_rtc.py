"""Real-time chunking on the PI0 fast path (agents/policies/pi0/rtc.py, pi0_fast.py) and on the wire
(learner/wire_guard.py ``check_rtc``): a tiny PI0 on a CPU (the fast path without graphs).

1. Through a real learner service and inference thread on loopback, four actors' requests in
   one forward: three with RTC and different delays, one without. Each RTC reply's first
   ``delay`` actions are the pending prefix sent; the plain row equals a plain act of its
   observation alone; guidance pulls the steps after the delay toward the prefix.
2. The sampler alone: frozen steps are exactly the normalised prefix; with delay 0 (guidance
   only) a batch equals lerobot's own ``sample_actions`` with its ``RTCProcessor``.
3. Bad RTC arrays get a ``bad_request`` naming the problem; a learner without rtc.enabled says so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from agents.policies.pi0.fast import FastPiSampler
from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
from agents.policies.pi0.rtc import RtcRows, RtcSettings, rtc_inputs
from data.core.codec import decode, encode
from data.core.schema import RTC_DELAY, RTC_PENDING, RTC_PREFIX
from data.core.spec import EnvSpec
from data.replay import ReplayBuffer
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (32, 32, 3)}, has_task=True)
H, A, HASH = 8, 7, "rtc"
SETTINGS = RtcSettings(enabled=True, execution_horizon=6)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    ck = make_pi0(tmp_path_factory.mktemp("rtc") / "pi0", SPEC, chunk_size=H, image_size=32)
    return Pi0Policy(Pi0PolicyConfig(checkpoint=str(ck), chunk_size=H, lora_rank=0, device="cpu",
                                     num_inference_steps=4), SPEC).eval()


def obs(i):
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal((1, 8)).astype(np.float32),
            "observation.images.image": rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)}


def rtc_arrays(seed, delay, pending):
    prefix = np.zeros((1, H, A), np.float32)
    prefix[0, :pending] = np.random.default_rng(100 + seed).uniform(-0.8, 0.8, (pending, A))
    return {RTC_PREFIX: prefix, RTC_DELAY: np.array([delay], np.int64), RTC_PENDING: np.array([pending], np.int64)}


class Learner:
    """A learner's service and inference thread around ``policy`` (real sockets)."""

    def __init__(self, policy, ports, rtc: bool):
        self.ctx = zmq.Context()
        box = {}
        self.svc = LearnerService(ctx=self.ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(16, SPEC)),
                                  submit_act=lambda r: box["inf"].submit(r), get_version=lambda: 0,
                                  get_weights=lambda: None, port=ports[0], pub_port=ports[1],
                                  rtc_chunk=H if rtc else 0)
        self.inf = box["inf"] = InferenceServer(policy, reply=self.svc.reply, active_actors=self.svc.active_actors,
                                                device=torch.device("cpu"), batch_window_ms=3000.0,
                                                rtc=SETTINGS if rtc else None)
        self.svc.start()
        self.inf.start()

    def dealer(self, i):
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.svc.port}")
        s.send_multipart(encode("hello", {"actor_id": f"a{i}", "config_hash": HASH, "resend_from": 0}))
        assert recv(s).type == "welcome"
        return s

    def close(self):
        self.inf.stop()
        self.svc.stop()
        self.inf.join(5)
        self.svc.join(5)
        self.ctx.destroy(0)


def recv(s, timeout_ms=60000):
    assert s.poll(timeout_ms), "no reply"
    return decode(s.recv_multipart())


def act(s, i, extra=None):
    s.send_multipart(encode("act", {"req_id": i, "deterministic": True, "tasks": ["reach the red target"]},
                            {**obs(i), **(extra or {})}))


def test_batched_rows_of_mixed_delays_keep_their_prefix_and_plain_rows_are_unaffected(policy, ports):
    ln = Learner(policy, ports, rtc=True)
    try:
        socks = [ln.dealer(i) for i in range(4)]
        rows = {0: (3, 6), 1: (0, 5), 2: (5, 8)}  # actor -> (delay, pending); actor 3: no RTC
        for i, s in enumerate(socks):
            act(s, i, rtc_arrays(i, *rows[i]) if i in rows else None)
        replies = [recv(s) for s in socks]
        assert [r.type for r in replies] == ["act_reply"] * 4, [r.fields for r in replies]
        assert ln.inf.batch_sizes[-1] == 4 and all(r["batch"] == 4 for r in replies)  # one forward
    finally:
        ln.close()
    got = [r.arrays["actions"][0] for r in replies]
    for i, (d, p) in rows.items():
        prefix = rtc_arrays(i, d, p)[RTC_PREFIX][0]
        np.testing.assert_allclose(got[i][:d], prefix[:d], atol=1e-6)  # frozen: the prefix sent
    # the plain row: a plain act of its observation alone (same deterministic noise)
    alone = {k: torch.from_numpy(v) for k, v in obs(3).items()}
    alone["task"] = ["reach the red target"]
    plain = policy.act(alone, deterministic=True).actions[0].numpy()
    np.testing.assert_allclose(got[3], plain, atol=1e-5)
    # guidance: past the delay (inside the execution horizon) RTC rows are nearer their prefix
    # than the unguided chunk of the same observation
    for i, (d, p) in rows.items():
        o = {k: torch.from_numpy(v) for k, v in obs(i).items()}
        o["task"] = ["reach the red target"]
        free = policy.act(o, deterministic=True).actions[0].numpy()
        prefix = rtc_arrays(i, d, p)[RTC_PREFIX][0]
        hi = min(p, SETTINGS.execution_horizon)
        if hi > d:
            assert np.abs(got[i][d:hi] - prefix[d:hi]).mean() < 0.8 * np.abs(free[d:hi] - prefix[d:hi]).mean()


def test_sampler_freezes_exactly_and_matches_lerobots_rtc_guidance(policy):
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    o = {k: torch.from_numpy(np.concatenate([obs(0)[k], obs(1)[k]])) for k in obs(0)}
    o["task"] = ["reach the red target", "reach the blue target"]
    inputs = policy.model_inputs(o)
    d = int(policy.lr_cfg.max_action_dim)
    noise = torch.randn(2, H, d, generator=torch.Generator().manual_seed(3))
    fast = policy._fast_sampler(force=True)
    prefix = np.concatenate([rtc_arrays(0, 0, 5)[RTC_PREFIX], rtc_arrays(1, 0, 5)[RTC_PREFIX]])
    norm = lambda a: policy.norm(a, "action")  # noqa: E731
    steps = int(policy.lr_cfg.num_inference_steps)

    def sample(delay, pending):
        rows = RtcRows(prefix, np.array(delay), np.array(pending), SETTINGS)
        kw = rtc_inputs(rows, norm, H, d, steps, policy.device)
        with torch.no_grad():
            return fast.sample(*inputs[:4], inputs[4], noise, steps, **kw), kw["rtc"]["rtc_prefix"]

    out, pn = sample([4, 2], [5, 5])
    assert torch.equal(out[0, :4], pn[0, :4]) and torch.equal(out[1, :2], pn[1, :2])  # exactly
    assert not torch.equal(out[1, 2:4], pn[1, 2:4])
    plain, fast = fast, FastPiSampler(policy.inner.model, policy.variant, graphs=False, compile=None, step_kv=True)
    buffered, _ = sample([4, 2], [5, 5])  # the steps' buffers (the default on a GPU): the same guided chunk
    torch.testing.assert_close(buffered, out, atol=2e-5, rtol=1e-4)
    assert torch.equal(buffered[0, :4], pn[0, :4])
    fast = plain
    # delay 0, both rows pending 5: lerobot's sample_actions with its RTCProcessor
    out, pn = sample([0, 0], [5, 5])
    model = policy.inner.model
    saved = model.config.rtc_config, model.rtc_processor
    model.config.rtc_config = RTCConfig(enabled=True, execution_horizon=SETTINGS.execution_horizon,
                                        max_guidance_weight=SETTINGS.max_guidance_weight)
    model.rtc_processor = SETTINGS.processor()
    try:
        with torch.no_grad():
            ref = model.sample_actions(*inputs, noise=noise, num_steps=steps, inference_delay=0,
                                       prev_chunk_left_over=pn[:, :5],
                                       execution_horizon=SETTINGS.execution_horizon)
            model.config.rtc_config = None
            unguided = model.sample_actions(*inputs, noise=noise, num_steps=steps)
    finally:
        model.config.rtc_config, model.rtc_processor = saved
    assert (ref - unguided).abs().max() > 1e-2  # lerobot's guidance changed its output
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bad_rtc_arrays_get_a_clear_error(policy, ports):
    ln = Learner(policy, ports, rtc=True)
    try:
        s = ln.dealer(0)
        good = rtc_arrays(0, 2, 5)
        nan = dict(good, **{RTC_PREFIX: good[RTC_PREFIX].copy()})
        nan[RTC_PREFIX][0, 1, 2] = np.nan
        cases = [
            ({**good, RTC_PREFIX: good[RTC_PREFIX][:, :4]}, "rtc.prefix: got float32(1, 4, 7), expected float32(1, 8, 7)"),
            (nan, "rtc.prefix: contains NaN or Inf"),
            ({**good, RTC_DELAY: np.array([6], np.int64)}, "rtc.delay: row 0 has delay 6; it must be in [0, pending] = [0, 5]"),
            ({**good, RTC_PENDING: np.array([9], np.int64)}, "rtc.pending: values must be in [0, 8]"),
            ({**good, RTC_DELAY: np.array([-1], np.int64)}, "rtc.delay: row 0 has delay -1"),
            ({k: v for k, v in good.items() if k != RTC_DELAY}, "missing ['rtc.delay']"),
            ({**good, RTC_DELAY: np.array([2.0])}, "rtc.delay: got float64(1,), expected int64(1,)"),
        ]
        for i, (arrays, message) in enumerate(cases):
            act(s, i, arrays)
            r = recv(s)
            assert r.type == "error" and r["code"] == "bad_request" and message in r["message"], (message, r.fields)
        act(s, 99, good)
        assert recv(s).type == "act_reply"  # the session serves on
    finally:
        ln.close()
    ln = Learner(policy, ports, rtc=False)
    try:
        s = ln.dealer(0)
        act(s, 1, rtc_arrays(0, 2, 5))
        r = recv(s)
        assert r["code"] == "bad_request" and "rtc.enabled=true" in r["message"] and "chunk.rtc=false" in r["message"]
    finally:
        ln.close()

