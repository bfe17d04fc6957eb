"""OpenVLA-OFT's compiled layer stack ahead of time (policy.fast_aot_dir, agents/policies/fast_aot.py)
on the CPU: a first process compiles it (batch 1 and the dynamic batch: two functions) and saves
them; a second process with an empty inductor cache, as a new machine, loads both without dynamo
tracing anything, serves other batch sizes and prompt lengths with them, and reads weights
written in place afterwards; each result equals the eager path's."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tandem_testutil import python_code
from test_oft_fast import ckpt  # noqa: F401 - the tiny checkpoint fixture

SERVE = textwrap.dedent("""
    import json, sys, torch
    from agents.policies.fast_common import compiled_graphs
    from test_oft_fast import TASKS, make, obs, perturb

    torch.set_num_threads(1)
    gpu = sys.argv[4] == "cuda"
    p = make(sys.argv[1], "l1", device=sys.argv[4], fast_serving="auto" if gpu else "eager", fast_compile=True,
             fast_aot_dir=sys.argv[2], **({"dtype": "bfloat16"} if gpu else {}))

    def both(o):
        with torch.no_grad():
            got = p.forward_model(p.model_inputs(o))
            mode, p.cfg.fast_serving = p.cfg.fast_serving, "off"
            want = p.forward_model(p.model_inputs(o))
            p.cfg.fast_serving = mode
        return float((got - want).abs().max()), float(want.abs().max())

    out = {"b3": both(obs(3)), "b1": both(obs(1))}
    if sys.argv[3] == "again":
        long = obs(5, seed=2)
        long["task"] = [TASKS[1] + " and then back to the start"] * 5   # another prompt length bucket
        out["b5_long"] = both(long)
        p.train(); perturb(p, scale=0.2, seed=9); p.eval()                 # new weights, in place
        out["new_weights"] = both(obs(3))
    a = p._fast.aot
    out.update(loaded=a.loaded, compiled=a.compiled, load_s=a.load_s, compile_s=a.compile_s,
               dynamo_graphs=compiled_graphs())
    print(json.dumps(out))
""")


def _serve(ckpt_path, folder, cache, phase, device="cpu"):
    code = f"import sys; sys.argv = ['x', {str(ckpt_path)!r}, {str(folder)!r}, {phase!r}, {device!r}]\n" + SERVE
    out = python_code(code, triton_interpret=False, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    return json.loads(out.strip().splitlines()[-1])


def test_a_new_machine_loads_the_stack_and_serves_without_tracing(ckpt, tmp_path):  # noqa: F811
    folder = tmp_path / "aot"
    first = _serve(ckpt, folder, tmp_path / "cache_a", "first")
    assert first["compiled"] == 2 and first["loaded"] == 0 and first["dynamo_graphs"] >= 2
    assert len(list(folder.glob("aot-oft-*.bin"))) == 2
    second = _serve(ckpt, folder, tmp_path / "cache_b", "again")       # an empty cache: a new machine
    assert second["loaded"] == 2 and second["compiled"] == 0 and second["dynamo_graphs"] == 0, second
    for name in ("b3", "b1", "b5_long", "new_weights"):
        err, scale = second[name]
        assert scale > 0.05 and err < 1e-4, (name, second[name])
    assert first["b3"] == second["b3"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_loaded_stack_is_captured_in_the_graphs(ckpt, tmp_path):  # noqa: F811
    folder = tmp_path / "aot"
    first = _serve(ckpt, folder, tmp_path / "cache_a", "first", "cuda")
    second = _serve(ckpt, folder, tmp_path / "cache_b", "again", "cuda")
    assert first["compiled"] == 2 and second["loaded"] == 2 and second["compiled"] == 0
    assert second["dynamo_graphs"] == 0, second
    for name in ("b3", "b1", "b5_long", "new_weights"):
        err, scale = second[name]
        assert err < 0.05 * scale + 1e-2, (name, second[name])      # bf16 against the eager path

