"""Policies are built whole under a registered ZeRO-3 config (agents.parallel.whole_weights).

accelerate registers its DeepSpeed config with transformers; with ZeRO-3, transformers then
constructs models inside ``deepspeed.zero.Init`` and the policies' own initialisation met
empty parameter shards on 2 H200s ("Fan in and fan out can not be computed ..."). Inside
``whole_weights`` transformers must see no ZeRO-3 config, and the config must be back after.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled  # noqa: E402

from agents.parallel import whole_weights  # noqa: E402


def test_whole_weights_hides_a_zero3_config_while_building_and_restores_it():
    assert not is_deepspeed_zero3_enabled()
    with whole_weights():  # nothing registered: a no-op
        assert not is_deepspeed_zero3_enabled()
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with whole_weights():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
        with pytest.raises(RuntimeError), whole_weights():  # restored on errors too
            raise RuntimeError("build failed")
        assert is_deepspeed_zero3_enabled()
    finally:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del keep


def test_zero2_configs_are_left_alone():
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1})
    try:
        with whole_weights():
            from transformers.integrations import deepspeed_config

            assert deepspeed_config() is not None  # still registered
    finally:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del keep
