"""The update-step benchmark runs the algorithms' own update code (tiny models on a CPU)."""

import math

import pytest

from tools.bench.train import main


@pytest.mark.slow
def test_bench_train_smoke_on_cpu():
    out = main(["--tiny", "--device", "cpu", "--cases", "oft_grpo,pi0_ppo,pi0_sft", "--batch", "4",
                "--minibatch", "2", "--iters", "1", "--image-size", "48"])
    for case in ("oft_grpo", "pi0_ppo", "pi0_sft"):
        r = out["cases"][case]
        assert "error" not in r, r
        assert r["batch"] == 4 and r["trainable_params_m"] > 0
        assert math.isfinite(r["update_ms"]["p50"]) and r["update_ms"]["p50"] > 0


def test_pi0_small_update_is_timed_under_each_matmul_precision():
    import torch

    before = torch.get_float32_matmul_precision()
    out = main(["--device", "cpu", "--cases", "pi0_small_sft", "--batch", "2", "--minibatch", "2",
                "--iters", "1", "--image-size", "32", "--matmul-precisions", "highest,high"])
    rows = out["cases"]["pi0_small_sft"]
    assert set(rows) == {"highest", "high"}
    for r in rows.values():
        assert "error" not in r, r
        assert 10.0 < r["trainable_params_m"] < 11.0   # config/policy/pi0_small.yaml's 10.4M
        assert math.isfinite(r["update_ms"]["p50"]) and r["update_ms"]["p50"] > 0
    assert torch.get_float32_matmul_precision() == before   # restored after the bench


def test_learner_refuses_an_unknown_matmul_precision_by_name():
    from learner.app import validate
    from tools.sft import learner_config

    validate(learner_config(["trainer.matmul_precision=high"]))
    with pytest.raises(ValueError, match="trainer.matmul_precision must be one of"):
        validate(learner_config(["trainer.matmul_precision=fp8"]))
