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
