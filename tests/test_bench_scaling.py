"""The scaling benchmark (tools/bench/scaling_cli.py) on the CPU: the tiny PI0, every parameter
trained, as one process and as 2 gloo ranks (torchrun), through the matrix driver."""

import json
import math
import socket
import sys

import pytest

from tools.bench.scaling_matrix import CONFIGS, command
from tools.bench.scaling_cli import main, parse

#: a 2-rank launch that could not start here (no loopback sockets, ...), not a benchmark failure
LAUNCH_PROBLEMS = ("DistNetworkError", "EADDRINUSE", "Address already in use", "Connection refused",
                   "gloo", "rendezvous", "Operation not permitted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_commands_per_config(tmp_path):
    args = parse(["--matrix", "--global-batch", "32", "--out-dir", str(tmp_path)])
    one = command(args, "pi0_full", "1gpu", 29600, tmp_path / "o.json")
    assert "--multi_gpu" not in one and "--use_deepspeed" not in one and one[one.index("--num_processes") + 1] == "1"
    z3 = command(args, "oft_lora", "2gpu_z3", 29600, tmp_path / "o.json")
    assert z3[z3.index("--num_processes") + 1] == "2" and "--use_deepspeed" in z3
    assert z3[z3.index("--deepspeed_config_file") + 1].endswith("config/deepspeed/zero3.json")
    assert z3[z3.index("--micro-batch") + 1] == "4"  # OFT's default micro-batch
    assert "--multi_gpu" in command(args, "pi0_lora", "2gpu_ddp", 29600, tmp_path / "o.json")
    assert set(CONFIGS) >= {"1gpu", "2gpu_z2", "2gpu_z3"}


def test_deepspeed_config_gets_the_accumulation(tmp_path, monkeypatch):
    """Under accelerate's DeepSpeed launch the engine's gradient_accumulation_steps (it scales the
    loss and steps at its boundaries) becomes the run's micro-batch count."""
    from pathlib import Path

    from tools.bench.scaling import patch_deepspeed_config

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(repo / "config/deepspeed/zero3.json"))
    cfg = patch_deepspeed_config(4, 8, tmp_path)
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 8
    written = json.loads(Path(os_environ("ACCELERATE_DEEPSPEED_CONFIG_FILE")).read_text())
    assert written["zero_optimization"]["stage"] == 3 and written["gradient_accumulation_steps"] == 4
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # what Accelerator() builds from the launch's environment
    assert int(plugin.zero_stage) == 3 and plugin.deepspeed_config["gradient_accumulation_steps"] == 4


def os_environ(key: str) -> str:
    import os

    return os.environ[key]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("TANDEM_BENCH_TESTS"),
                    reason="launches 3 processes that each build a tiny PI0 (2-5 min on 2 cores); "
                           "set TANDEM_BENCH_TESTS=1 (the 2-rank equivalence is tests/test_distributed.py)")
def test_tiny_matrix_one_and_two_cpu_ranks(tmp_path):
    out = tmp_path / "out"
    rows = main(["--matrix", "--tiny", "--cpu", "--cases", "pi0_full", "--configs", "1gpu,2gpu_ddp",
                 "--global-batch", "4", "--micro-batch", "2", "--warmup", "1", "--steps", "1",
                 "--image-size", "32", "--out-dir", str(out), "--port", str(_free_port()),
                 "--python", sys.executable, "--launch-timeout-s", "240"])
    by = {r["config"]: r for r in rows}
    one = by["1gpu"]
    assert one["error"] is None, one
    for r in rows:
        if r is not one and r.get("error"):
            log = open(r["log"]).read()
            if any(p in log for p in LAUNCH_PROBLEMS) and "samples_per_s" not in r:
                pytest.skip(f"2-process gloo launch impossible here: {r['error'][:300]}")
            raise AssertionError(r)
    two = by["2gpu_ddp"]
    for r, world, accum in ((one, 1, 2), (two, 2, 1)):
        assert r["world"] == world and r["mode"] == ("single" if world == 1 else "ddp")
        assert r["global_batch"] == 4 and r["per_rank_batch"] == 4 // world and r["accum_steps"] == accum
        assert math.isfinite(r["step_s_p50"]) and r["step_s_p50"] > 0
        assert r["samples_per_s"] == pytest.approx(4 / r["step_s_p50"])
        assert r["trainable_params_m"] == pytest.approx(r["params_m"]) and r["params_m"] > 0  # no LoRA
        assert len(r["per_rank"]) == world and all("step_s_p50" in m for m in r["per_rank"])
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    assert two["vs_1gpu"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["vs_1gpu"] / 2)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["config"] for r in summary["rows"]] == ["1gpu", "2gpu_ddp"]
    assert "efficiency" in (out / "summary.md").read_text()
