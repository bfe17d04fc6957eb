"""The VLA policies inside the learner's batched inference, over real loopback sockets, and the
CPU smoke run of tools/bench/policy.py."""

import json

import numpy as np
import pytest
import torch
import zmq

from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
from agents.policies.vla_common import state_nbytes
from data.core.codec import decode, encode
from data.replay import ReplayBuffer
from data.core.spec import EnvSpec
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher
from tools.bench import policy as bench_policy
from tools.make_tiny_checkpoints import make_openvla_oft, make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (32, 32, 3), "wrist_image": (32, 32, 3)}, has_task=True)
HASH = "vla"


def build(kind, tmp):
    if kind == "pi0":
        return Pi0Policy(Pi0PolicyConfig(checkpoint=str(make_pi0(tmp / "pi0", SPEC)), chunk_size=8, lora_rank=4), SPEC)
    return OpenVLAOFTPolicy(OpenVLAOFTPolicyConfig(checkpoint=str(make_openvla_oft(tmp / "oft", SPEC)), lora_rank=4), SPEC)


def obs(i):
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal((1, 8)).astype(np.float32),
            "observation.images.image": rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8),
            "observation.images.wrist_image": rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)}


def dealer(ctx, port):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def recv(s, timeout_ms=60000):
    assert s.poll(timeout_ms), "no reply"
    return decode(s.recv_multipart())


@pytest.mark.parametrize("kind", ["pi0", "openvla_oft"])
def test_n_actors_share_one_forward_and_replies_carry_the_version(kind, tmp_path, ports):
    policy = build(kind, tmp_path).eval()
    snap = policy.trainable_state_dict()
    full = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    print(f"\n{kind}: trainable snapshot {state_nbytes(snap) / 1e3:.1f} kB ({len(snap)} tensors) vs full model "
          f"{full / 1e3:.1f} kB ({state_nbytes(snap) / full:.1%})")
    ctx = zmq.Context()
    box = {}
    svc = LearnerService(ctx=ctx, spec=SPEC, config_hash=HASH, ingest=Ingest(ReplayBuffer(16, SPEC)),
                         submit_act=lambda r: box["inf"].submit(r), get_version=lambda: box["w"].version,
                         get_weights=lambda: box["w"].latest(), port=ports[0], pub_port=ports[1])
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors, device=torch.device("cpu"),
                          batch_window_ms=2000.0)
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(snap, version=3)
    svc.start()
    inf.start()
    n = 4
    socks = [dealer(ctx, svc.port) for _ in range(n)]
    try:
        for i, s in enumerate(socks):
            s.send_multipart(encode("hello", {"actor_id": f"a{i}", "config_hash": HASH, "resend_from": 0}))
            assert recv(s).type == "welcome"
        tasks = ["pick up the bowl", "open the drawer", "push the plate", "turn on the stove"]

        def round_trip():
            before = inf.batches
            for i, s in enumerate(socks):
                s.send_multipart(encode("act", {"req_id": i, "deterministic": True, "tasks": [tasks[i]]}, obs(i)))
            replies = [recv(s) for s in socks]
            return replies, inf.batches - before

        replies, forwards = round_trip()
        assert forwards == 1 and inf.batch_sizes[-1] == n
        assert [r.type for r in replies] == ["act_reply"] * n
        assert all(r["batch"] == n and r["policy_version"] == 3 for r in replies)
        assert [r["req_id"] for r in replies] == list(range(n))
        assert all(r.arrays["actions"].shape == (1, policy.chunk_size, 7) for r in replies)
        # each actor gets its own row: the same as a forward of its observation alone
        alone = {k: torch.from_numpy(v) for k, v in obs(2).items()}
        alone["task"] = [tasks[2]]
        np.testing.assert_allclose(replies[2].arrays["actions"][0], policy.act(alone, deterministic=True).actions[0],
                                   atol=1e-5)
        # a new trainable snapshot: the next batch is served by it and says so
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in snap.items()}
        box["w"].publish(new)
        replies2, forwards = round_trip()
        assert forwards == 1 and all(r["policy_version"] == 4 for r in replies2)
        assert not np.allclose(replies2[0].arrays["actions"], replies[0].arrays["actions"])
    finally:
        inf.stop()
        svc.stop()
        inf.join(5)
        svc.join(5)
        ctx.destroy(0)


def test_bench_policy_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    res = bench_policy.main(["--tiny", "--device", "cpu", "--actors", "1,2", "--seconds", "1", "--iters", "6",
                             "--max-iters", "12", "--warmup", "1", "--train-batch", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["policies"].keys() == {"pi0", "pi05", "openvla_oft"}
    assert data["peak_matmul"]["tflops"] > 0 and data["peak_matmul"]["dtype"] == "float32"
    for name, r in res["policies"].items():
        assert r["bare_forward_ms"]["p50"] > 0 and r["act_ms"]["p50"] > 0 and r["train_step_ms"]["p50"] > 0
        assert [a["actors"] for a in r["actors"]] == [1, 2] and all(a["chunks"] > 0 for a in r["actors"])
        assert r["actors"][0]["reply_shape"] == [1, r["chunk"], 7]
        assert 0 < r["snapshot_mb"] < r["model_mb"]
        # every latency carries the 95% interval of its median; no GPU fields on the CPU
        for key in ("bare_forward_ms", "act_ms"):
            s = r[key]
            assert 6 <= s["n"] <= 12 and s["ci95"][0] <= s["p50"] <= s["ci95"][1], (key, s)
            assert isinstance(s["stable"], bool) and s["ci_rel"] >= 0
        assert r["gpu_before"] is None and r["gpu_after"] is None
        assert isinstance(r["warnings"], list)
        # FLOPs per call grow with the batch; MFU per batch size and per actor level
        assert set(r["flops"]) == set(r["by_batch"]) == {"1", "4", "8"}
        assert r["flops"]["1"] > 0 and r["flops"]["4"] > 3 * r["flops"]["1"]
        assert all(0 < x["mfu"] and x["tflops"] > 0 for x in r["by_batch"].values())
        assert all(a["tflops"] > 0 and a["mfu"] > 0 for a in r["actors"])
    for v in ("pi0", "pi05"):
        r = res["policies"][v]
        assert r["lerobot_select_action_ms"]["p50"] > 0 and r["speedup_vs_lerobot"] > 0
        assert 0 < r["prompt_tokens"] < r["prompt_tokens_full"] == (48 if v == "pi0" else 200)
