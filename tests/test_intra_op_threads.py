"""trainer.num_threads (learner/distributed.py intra_op_threads): auto is one intra-op thread on a
GPU learner and torch's default on a CPU; a bad value is refused by the learner, naming the key."""

from __future__ import annotations

import pytest
import torch

from learner.distributed import cpu_offload, intra_op_threads
from tandem_testutil import free_port


def test_auto_is_one_thread_on_a_gpu_and_torchs_default_on_a_cpu():
    assert intra_op_threads("auto", gpu=True) == 1
    assert intra_op_threads("auto", gpu=False) is None
    assert intra_op_threads(None, gpu=True) == 1                 # (a config without the key)
    assert intra_op_threads(0, gpu=True) is None and intra_op_threads("0", gpu=False) is None
    assert intra_op_threads(3, gpu=True) == 3 and intra_op_threads("4", gpu=False) == 4


def test_deepspeeds_cpu_offload_keeps_torchs_default(tmp_path):
    """DeepSpeed's CPU optimizer runs on OpenMP threads: auto leaves them alone where it offloads."""
    from omegaconf import OmegaConf

    assert intra_op_threads("auto", gpu=True, offload=True) is None
    assert intra_op_threads(2, gpu=True, offload=True) == 2
    cfg = lambda **ds: OmegaConf.create({"deepspeed": {"stage": 0, "config": None, **ds}})  # noqa: E731
    assert not cpu_offload(cfg()) and not cpu_offload(cfg(stage=2)) and not cpu_offload(cfg(stage=3))
    off = tmp_path / "zero2_offload.json"
    off.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}')
    assert cpu_offload(cfg(stage=2, config=str(off)))
    assert not cpu_offload(cfg(stage=0, config=str(off)))           # plain DDP reads no DeepSpeed config


@pytest.mark.parametrize("bad", ["many", -1, True, 1.5j])
def test_anything_else_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match="trainer.num_threads"):
        intra_op_threads(bad, gpu=True)


def test_the_learner_refuses_a_bad_thread_count_before_it_opens_anything(tmp_path):
    from learner.app import Learner
    from test_extras_e2e import learner_cfg

    cfg = learner_cfg(tmp_path / "run", free_port(), free_port(), "buffer.persist=false")
    cfg.trainer.num_threads = "many"
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="trainer.num_threads must be auto"):
        Learner(cfg)
    assert torch.get_num_threads() == before and not (tmp_path / "run").exists()
