"""Portable compile artefacts (agents/policies/fast_common.py, ``inference.compile_artifacts``):
what a serving warm-up compiled, saved by one process and loaded by another with an empty
inductor cache, makes the second one's compile a cache hit. The round trip compiles with
inductor on the CPU (~40 s on 2 cores): behind TANDEM_BENCH_TESTS=1; the file checks always run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from agents.policies.fast_common import compile_artifacts_file, load_compile_artifacts

ROOT = Path(__file__).resolve().parents[1]

SERVE = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from learner.inference import InferenceServer

    class Warm:   # a policy whose warm-up compiles, as the fast PI0 / OFT paths do on a GPU
        def warm_up(self, max_batch):
            f = torch.compile(lambda x: torch.nn.functional.gelu(x * 2.0 + 1.0).sum())
            f(torch.randn(64))
            return {1: 0.0}

    InferenceServer(Warm(), reply=lambda *a: None, active_actors=lambda: 1, device=torch.device("cpu"),
                    compile_artifacts=sys.argv[1])
    print(json.dumps(dict(counters["inductor"])))
""")


def _serve(folder: Path, cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SERVE, str(folder)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.environ.get("TANDEM_BENCH_TESTS"), reason="compiles twice (~40 s): TANDEM_BENCH_TESTS=1")
def test_a_fresh_machine_reads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "ckpt" / "compile"
    first = _serve(folder, tmp_path / "cache_a")
    assert first.get("fxgraph_cache_miss", 0) >= 1           # compiled here
    saved = Path(compile_artifacts_file(folder, "cpu"))
    assert saved.is_file() and saved.stat().st_size > 0
    second = _serve(folder, tmp_path / "cache_b")            # an empty inductor cache: a new machine
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0, second


def test_the_file_is_keyed_by_device_and_torch_and_a_bad_one_is_skipped(tmp_path, caplog):
    path = compile_artifacts_file(tmp_path, "cpu")
    assert Path(path).parent == tmp_path and "cpu" in path and torch.__version__.split("+")[0] in path
    assert load_compile_artifacts(tmp_path, "cpu") is False  # none yet: nothing to load
    Path(path).write_bytes(b"not an artefact file")
    with caplog.at_level("WARNING"):
        assert load_compile_artifacts(tmp_path, "cpu") is False
    assert path in caplog.text and "compiling instead" in caplog.text
