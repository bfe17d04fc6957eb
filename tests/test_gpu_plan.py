"""tools/bench/gpu_plan.sh: the one-GPU issue's measurements as resumable stages on a GPU box.
On the CPU: the stage list, an unknown stage refused, the tiles stage run for real from a sweep's
JSON (its .done marker, skipped when run again, the status lines, the collected archive), and a
GPU stage that fails here recorded as failed with its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from test_bench_step_tiles import SWEEP
from tools.bench.pi0_step_kernels import best_tiles

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tools" / "bench" / "gpu_plan.sh"


def plan(*args: str, stages: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_PY": sys.executable, "TANDEM_PLAN_NO_KIT": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if stages is not None:
        env["STAGES"] = stages
    return subprocess.run(["bash", str(PLAN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_stages_in_order_and_an_unknown_one_refused():
    r = plan("list")
    assert r.returncode == 0, r.stderr
    assert [ln.split(" ")[0] for ln in r.stdout.splitlines()] == ["tests", "gpu_new", "sim_due", "sim_osmesa", "kernels", "tiles", "levers",
                                                                    "one_gpu", "pi0_serve", "sim_threads", "oft_fp8", "oft_fp8_serve", "aot_start", "oft_start", "pi0_start",
                                                                    "pi05"]
    assert "tools.bench.one_gpu --repeats 1" in r.stdout
    bad = plan("list", stages="tiles bench")
    assert bad.returncode == 2 and "unknown stage 'bench'" in bad.stderr


def test_a_stage_runs_once_and_its_results_come_back(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    (out / "kernels.json").write_text(json.dumps(SWEEP))
    r = plan("run", str(out), stages="tiles")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "tiles.json").read_text()) == best_tiles(SWEEP)
    assert (out / "tiles.done").exists() and "tiles: ok in" in (out / "status").read_text()
    (out / "tiles.json").write_text("{}")            # run again: skipped, its output kept
    plan("run", str(out), stages="tiles")
    assert (out / "tiles.json").read_text() == "{}"
    assert "tiles: done before, skipped" in (out / "status").read_text()
    c = plan("collect", str(out), str(tmp_path / "dest"), stages="tiles")
    assert c.returncode == 0 and c.stdout.strip() == "tiles: ok"
    with tarfile.open(tmp_path / "dest" / "gpu_plan.tgz") as t:
        assert {"./tiles.json", "./tiles.done", "./status", "./kernels.json", "./finished"} <= set(t.getnames())


def test_a_stage_that_fails_is_recorded_with_its_exit_code_and_not_marked_done(tmp_path):
    out = tmp_path / "plan"
    r = plan("run", str(out), stages="kernels")      # the kernel bench needs a GPU: exits 2
    assert r.returncode == 0, r.stderr
    assert not (out / "kernels.done").exists()
    assert "needs a GPU" in (out / "kernels.log").read_text()
    s = plan("status", str(out), stages="kernels tiles")
    assert s.stdout.splitlines()[0].startswith("kernels: failed rc 2") and s.stdout.splitlines()[1] == "tiles: to do"
