"""``inference.device``: where the learner's serving copy runs (learner/app.py serving_device)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from learner.app import serving_device


def cfg(device):
    return OmegaConf.create({"inference": {"device": device, "max_batch": 8}})


def test_default_is_the_learner_device_and_an_explicit_one_is_used():
    assert serving_device(cfg(None), torch.device("cpu")) == torch.device("cpu")
    assert serving_device(cfg(""), torch.device("cpu")) == torch.device("cpu")
    assert serving_device(cfg("cpu"), torch.device("cpu")) == torch.device("cpu")


def test_a_device_this_machine_lacks_is_named():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="inference.device|no CUDA device"):
        serving_device(cfg(f"cuda:{n + 3}"), torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_second_gpu_serves():
    assert serving_device(cfg("cuda:1"), torch.device("cuda:0")) == torch.device("cuda:1")


# ---- inference.cuda_stream: the CUDA stream serving's kernels go on -------------------------

def test_an_unknown_cuda_stream_is_named():
    from learner.inference import InferenceServer, serving_stream

    with pytest.raises(ValueError, match="inference.cuda_stream.*'fast'"):
        InferenceServer(None, reply=lambda *a: None, active_actors=lambda: 1, device=torch.device("cpu"),
                        cuda_stream="fast")
    assert serving_stream(torch.device("cpu"), "priority") is None   # off a GPU: nothing to choose


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["priority", "own", "shared"])
def test_serving_runs_on_the_chosen_stream(mode):
    """A real InferenceServer on the GPU: the policy's act runs on a stream of serving's own at
    the highest priority (``priority``), at normal priority (``own``) or on the default stream
    (``shared``); weights published from the caller's stream serve the next act, whose actions
    equal those of the same act called directly."""
    import threading

    import numpy as np

    from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
    from data.core.spec import EnvSpec
    from learner.act_intake import ActRequest
    from data.core.codec import decode
    from learner.inference import InferenceServer

    spec = EnvSpec(state_dim=6, action_dim=3, cameras={})
    seen = []

    class Recording(MLPPolicy):
        def act(self, obs, **kw):
            s = torch.cuda.current_stream()
            seen.append((s.cuda_stream, s.priority))
            return super().act(obs, **kw)

    dev = torch.device("cuda")
    policy = Recording(MLPPolicyConfig(hidden_dims=(16,)), spec).to(dev).eval()
    replies, done = [], threading.Event()
    inf = InferenceServer(policy, reply=lambda ident, frames: (replies.append(frames), done.set()),
                          active_actors=lambda: 1, device=dev, cuda_stream=mode)
    inf.start()
    try:
        state = np.random.default_rng(0).standard_normal((1, 6)).astype(np.float32)
        inf.submit(ActRequest(identity=b"a", req_id=0, deterministic=True,
                              arrays={"observation.state": state}, tasks=[""]))
        assert done.wait(60), "no reply"
        # new weights made on this thread's (the trainer's) stream are what the next act serves
        new = {k: v.detach() * 0.5 + 0.1 for k, v in policy.trainable_state_dict().items()}
        done.clear()
        inf.set_weights(7, new)
        inf.submit(ActRequest(identity=b"a", req_id=1, deterministic=True,
                              arrays={"observation.state": state}, tasks=[""]))
        assert done.wait(60), "no second reply"
    finally:
        inf.stop()
        inf.join(10)
    assert len({x for x in seen}) == 1
    stream, priority = seen[0]
    default = torch.cuda.default_stream(dev)
    high = torch.cuda.Stream.priority_range()[1]
    if mode == "shared":
        assert stream == default.cuda_stream
    else:
        assert stream != default.cuda_stream
        assert priority == (high if mode == "priority" else 0)
    first, second = decode(replies[0]), decode(replies[1])
    assert second["policy_version"] == 7
    direct = policy.act({"observation.state": torch.from_numpy(state).to(dev), "task": [""]}, deterministic=True)
    np.testing.assert_allclose(second.arrays["actions"], direct.actions.cpu().numpy(), atol=1e-6)
    assert not np.allclose(first.arrays["actions"], second.arrays["actions"])
