"""Serving draws its randomness from the inference server's own generator, never from torch's
global RNG (which training draws from on the main thread): ``policy.act(obs, generator=g)``
draws only from ``g``, and the real InferenceServer behind a real LearnerService on loopback
leaves ``torch.get_rng_state()`` as it was, serving the same stochastic actions for the same
seed and requests (learner/inference.py, "Randomness")."""

import numpy as np
import pytest
import torch
import zmq

from agents import registry
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.codec import decode, encode
from data.core.spec import EnvSpec
from data.replay import ReplayBuffer
from learner.inference import SERVING_SEED_OFFSET, InferenceServer, accepts_generator
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher
from tandem_testutil import free_port
from tools.make_tiny_checkpoints import make_openvla_oft, make_pi0

SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
HASH = "rng"
CHUNK = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_rng")
    return {"pi0": make_pi0(root / "pi0", SPEC, chunk_size=CHUNK)}


def make(kind, ckpts, tmp_path=None):
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8, chunk_size=2),
                         SPEC).eval()
    if kind == "residual_mlp":
        from agents.sac.residual_actor import ResidualPolicy

        return ResidualPolicy(make("mlp", ckpts), hidden_dims=(16,)).eval()
    if kind == "oft_discrete":
        ckpt = make_openvla_oft(tmp_path / "oft", SPEC)
        return registry.build_policy({"name": "openvla_oft_discrete", "checkpoint": str(ckpt), "chunk_size": CHUNK,
                                      "lora_rank": 4}, SPEC).eval()
    cfg = {"name": "pi0", "checkpoint": str(ckpts["pi0"]), "chunk_size": CHUNK, "lora_rank": 4,
           "num_inference_steps": 3, "device": "cpu"}
    if kind == "pi0_sde":
        cfg["flow_rl"] = "sde"
    p = registry.build_policy(cfg, SPEC)
    if kind == "noise_space_pi0":
        from agents.sac.noise_actor import NoiseSpacePolicy

        p = NoiseSpacePolicy(p, hidden_dims=(16,))
    return p.eval()


def obs_arrays(i, n=1):
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal((n, 4)).astype(np.float32),
            "observation.images.image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)}


def obs(i, n=2):
    o = {k: torch.from_numpy(v) for k, v in obs_arrays(i, n).items()}
    o["task"] = ["reach the red target", "reach the blue target"][:n]
    return o


def gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def device_of(policy) -> torch.device:
    """Where the policy's act runs (a tiny OFT builds on the GPU when there is one; the server's
    generator lives on that device, so the test's does too)."""
    return next(policy.parameters()).device


def rng_states() -> list[torch.Tensor]:
    """torch's global RNG states: the CPU's and, with a GPU, the current device's."""
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if torch.cuda.is_available() else [])


def chunk_arrays(c):
    return [c.actions, *(v for _, v in sorted(c.extras_with_log_prob().items()))]


@pytest.mark.parametrize("kind", ["mlp", "pi0", "pi0_sde", "oft_discrete", "residual_mlp", "noise_space_pi0"])
def test_act_with_a_generator_draws_only_from_it(kind, ckpts, tmp_path):
    p = make(kind, ckpts, tmp_path)
    assert accepts_generator(p.act)
    o, dev = obs(1), device_of(p)
    state = rng_states()
    a, b, c = (p.act(o, generator=gen(5, dev)), p.act(o, generator=gen(5, dev)),
               p.act(o, generator=gen(6, dev)))
    assert all(map(torch.equal, rng_states(), state))  # the global RNGs did not move
    for x, y in zip(chunk_arrays(a), chunk_arrays(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(a.actions, c.actions)
    # without one, the act draws from the global RNG as before (torch.manual_seed replays it)
    torch.manual_seed(7)
    d = p.act(o)
    assert not all(map(torch.equal, rng_states(), state))
    torch.manual_seed(7)
    torch.testing.assert_close(p.act(o, generator=None).actions, d.actions, rtol=0, atol=0)


def serve(policy, seed, requests, device=torch.device("cpu")):
    """``requests`` [(observation seed, rows, deterministic)] one after the other through a
    LearnerService and InferenceServer (serving on ``device``) on loopback; each reply's arrays."""
    ctx = zmq.Context()
    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH,
                         ingest=Ingest(ReplayBuffer(16, SPEC)), submit_act=lambda r: box["inf"].submit(r),
                         get_version=lambda: box["w"].version, get_weights=lambda: box["w"].latest(),
                         port=free_port(), pub_port=free_port())
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors, device=device,
                          batch_window_ms=1.0, seed=seed)
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(policy.trainable_state_dict(), version=1)
    svc.start()
    inf.start()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{svc.port}")
    out = []
    try:
        def rpc(frames):
            s.send_multipart(frames)
            assert s.poll(20000), "no reply"
            return decode(s.recv_multipart())

        assert rpc(encode("hello", {"actor_id": "a0", "config_hash": HASH, "resend_from": 0})).type == "welcome"
        for i, (k, n, det) in enumerate(requests):
            r = rpc(encode("act", {"req_id": i, "deterministic": det, "tasks": ["reach the red target"] * n},
                           obs_arrays(k, n)))
            assert r.type == "act_reply", r.meta
            out.append(dict(r.arrays))
    finally:
        inf.stop()
        svc.stop()
        inf.join(5)
        svc.join(5)
        ctx.destroy(0)
    assert inf.served == len(requests)
    return out


REQUESTS = [(0, 1, False), (1, 2, False), (0, 1, True), (2, 1, False), (0, 1, False)]


@pytest.mark.parametrize("kind", ["mlp", "pi0"])
def test_the_server_serves_from_its_own_seeded_generator(kind, ckpts):
    policy = make(kind, ckpts)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = serve(policy, 3, REQUESTS)
    assert torch.equal(torch.get_rng_state(), state)  # serving never drew from the global RNG
    b, c = serve(policy, 3, REQUESTS), serve(policy, 4, REQUESTS)
    assert torch.equal(torch.get_rng_state(), state)
    for ra, rb, rc, (_, _, det) in zip(a, b, c, REQUESTS):
        assert ra.keys() == rb.keys()
        for key in ra:
            np.testing.assert_array_equal(ra[key], rb[key])  # the same seed serves the same actions
        if det:
            np.testing.assert_array_equal(ra["actions"], rc["actions"])
        else:
            assert not np.array_equal(ra["actions"], rc["actions"])  # another seed, other draws
    # the same observation asked twice gets fresh draws (the stream goes on)
    assert not np.array_equal(a[0]["actions"], a[4]["actions"])
    # the first stochastic reply is the policy's act with the server's generator as seeded
    o = obs(0, 1)
    o["task"] = ["reach the red target"]
    want = policy.act(o, generator=gen(3 + SERVING_SEED_OFFSET)).actions.numpy()
    np.testing.assert_allclose(a[0]["actions"], want, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_on_a_gpu_serving_leaves_the_global_rngs_alone(name):
    """The generator lives on the serving GPU; neither the CPU's nor the GPU's global RNG moves,
    the warm-up's draws included (it runs inside fork_rng)."""
    dev = torch.device(name)
    policy = make("mlp", {}).to(dev)
    policy.warm_up = lambda *, max_batch: (torch.randn(max_batch, device=dev), {})[1]  # draws, as a graph warm-up's acts do
    o = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in obs(1).items()}
    torch.manual_seed(5)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(dev)
    g = [torch.Generator(device=dev).manual_seed(1) for _ in range(2)]
    torch.testing.assert_close(policy.act(o, generator=g[0]).actions, policy.act(o, generator=g[1]).actions,
                               rtol=0, atol=0)
    a, b, c = serve(policy, 3, REQUESTS, dev), serve(policy, 3, REQUESTS, dev), serve(policy, 4, REQUESTS, dev)
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(dev), gpu)
    for ra, rb, rc, (_, _, det) in zip(a, b, c, REQUESTS):
        np.testing.assert_array_equal(ra["actions"], rb["actions"])
        assert det or not np.array_equal(ra["actions"], rc["actions"])


def test_a_policy_without_the_keyword_is_served_as_before():
    class Plain:
        chunk_size = 1

        def act(self, obs, *, deterministic=False):
            from agents.base import ActionChunk

            return ActionChunk(torch.randn(obs["observation.state"].shape[0], 1, 2))

    assert not accepts_generator(Plain().act) and accepts_generator(make("mlp", {}).act)
    inf = InferenceServer(Plain(), reply=lambda *a: None, active_actors=lambda: 1, device=torch.device("cpu"))
    assert inf._act_kw == {}
    inf.start()
    inf.stop()
    inf.join(5)
