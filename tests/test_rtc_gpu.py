"""Real-time chunking in the PI0 fast path's CUDA graphs (agents/policies/pi0/fast.py): one
captured graph per bucket serves RTC batches of any delays and equals the eager fast path. Only
the policy and the RTC module are imported (it runs on a bare GPU box with lerobot carried)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
from agents.policies.pi0.rtc import RtcRows, RtcSettings
from data.core.schema import RTC_PREFIX
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (32, 32, 3)}, has_task=True)
H, A = 8, 7
SETTINGS = RtcSettings(enabled=True, execution_horizon=6)


def obs(i):
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal((1, 8)).astype(np.float32),
            "observation.images.image": rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)}


def rtc_arrays(seed, delay, pending):
    prefix = np.zeros((1, H, A), np.float32)
    prefix[0, :pending] = np.random.default_rng(100 + seed).uniform(-0.8, 0.8, (pending, A))
    return {RTC_PREFIX: prefix}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compile_", [False, True])
def test_rtc_in_cuda_graphs_matches_eager_on_a_gpu(tmp_path, compile_):
    """One captured graph per bucket serves RTC batches of any delays: it equals the eager fast
    path (float32, so the comparison is tight), keeps frozen steps, and a plain batch after it
    still uses the plain graph."""
    ck = make_pi0(tmp_path / "pi0", SPEC, chunk_size=H, image_size=32)
    p = Pi0Policy(Pi0PolicyConfig(checkpoint=str(ck), chunk_size=H, lora_rank=0, device="cuda", dtype="float32",
                                  fast_serving="graphs", fast_compile=compile_, num_inference_steps=4), SPEC).eval()
    d = int(p.lr_cfg.max_action_dim)

    def batch(b):
        o = {k: torch.from_numpy(np.concatenate([obs(i)[k] for i in range(b)])) for k in obs(0)}
        o["task"] = ["reach the red target"] * b
        return o

    def rows(delays, pendings):
        prefix = np.concatenate([rtc_arrays(i, 0, pendings[i])[RTC_PREFIX] for i in range(len(delays))])
        return RtcRows(prefix, np.array(delays), np.array(pendings), SETTINGS)

    with torch.inference_mode():
        for delays, pendings in (([3, 0, 5], [6, 5, 8]), ([1, 4, 0], [2, 7, 0])):  # the same bucket (4)
            r = rows(delays, pendings)
            noise = torch.randn(3, H, d, generator=torch.Generator().manual_seed(sum(delays))).cuda()
            g = p.act(batch(3), noise=noise, rtc=r).actions.cpu()
            p.cfg.fast_serving, fast = "eager", p._fast
            p._fast = None
            e = p.act(batch(3), noise=noise, rtc=r).actions.cpu()
            p.cfg.fast_serving, p._fast = "graphs", fast
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
            for i, (dl, pd) in enumerate(zip(delays, pendings)):
                k = min(dl, pd)
                torch.testing.assert_close(g[i, :k], torch.from_numpy(r.prefix[i, :k]), atol=1e-6, rtol=0)
        caps = fast.captures
        assert caps == 1, caps  # one RTC graph for bucket 4, replayed with other delays
        plain = p.act(batch(3), noise=noise).actions
        assert fast.captures == caps + 1 and plain.shape == (3, H, A)
