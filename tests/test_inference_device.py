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
