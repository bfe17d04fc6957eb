"""PI0's prefix stages ahead of time (policy.fast_aot_dir: SigLIP and the VLM stack,
agents/policies/pi0/fast_stages.py through agents/policies/fast_aot.py) on the CPU: a first process
compiles them (SigLIP over both cameras at once: one function; the VLM stack at batch 1 and the
dynamic batch: two) and saves them; a second process with an empty inductor cache, as a new
machine, loads all three and traces only the denoising step, serves another batch size and
prompt, and reads weights written in place afterwards; every result equals lerobot's own
``sample_actions`` on the same noise."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tandem_testutil import python_code
from test_pi0_fast import SPEC, CHUNK

SERVE = textwrap.dedent("""
    import json, sys, torch
    from agents.policies.fast_common import compiled_graphs
    from test_pi0_fast import both, make, obs

    torch.set_num_threads(1)
    gpu = sys.argv[4] == "cuda"
    p = make(sys.argv[1], "pi0", device=sys.argv[4], fast_serving="auto" if gpu else "eager", fast_compile=True,
             fast_aot_dir=sys.argv[2], **({"dtype": "bfloat16"} if gpu else {}))
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(5, 8, 32, generator=g).to(sys.argv[4])  # (lerobot's reference path takes it as given)

    def err(o):
        fast, ref = both(p, o, noise[: o["observation.state"].shape[0]])
        return float((fast - ref).abs().max()), float(ref.abs().max())

    out = {"b3": err(obs(3)), "b1": err(obs(1))}
    if sys.argv[3] == "again":
        o = obs(5, seed=2)
        o["task"] = ["put the cream cheese in the bowl and then the bowl on the plate"] * 5
        out["b5_long"] = err(o)
        with torch.no_grad():                               # new weights, in place (the base layers)
            for prm in p.inner.model.paligemma_with_expert.paligemma.parameters():
                prm.mul_(1.05)
        out["new_weights"] = err(obs(3))
    out.update({k: [a.loaded, a.compiled, a.failed] for k, a in p._fast.aot.items()}, dynamo_graphs=compiled_graphs())
    print(json.dumps(out))
""")


def _serve(ckpt_path, folder, cache, phase, device="cpu"):
    code = f"import sys; sys.argv = ['x', {str(ckpt_path)!r}, {str(folder)!r}, {phase!r}, {device!r}]\n" + SERVE
    out = python_code(code, triton_interpret=False, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(600)  # two processes compiling PI0's stages on a CPU: ~3 min alone, more beside other tests
def test_a_new_machine_loads_the_prefix_stages_and_traces_only_the_step(tmp_path):
    from tools.make_tiny_checkpoints import make_pi0

    ckpt = make_pi0(tmp_path / "pi0", SPEC, variant="pi0", chunk_size=CHUNK)
    folder = tmp_path / "aot"
    first = _serve(ckpt, folder, tmp_path / "cache_a", "first")
    assert first["vision"] == [0, 1, 0] and first["prefix"] == [0, 2, 0], first
    assert len(list(folder.glob("aot-pi0-*.bin"))) == 3
    second = _serve(ckpt, folder, tmp_path / "cache_b", "again")      # an empty cache: a new machine
    assert second["vision"] == [1, 0, 0] and second["prefix"] == [2, 0, 0], second
    assert second["dynamo_graphs"] < first["dynamo_graphs"]             # only the denoising step traced
    for name in ("b3", "b1", "b5_long", "new_weights"):
        e, scale = second[name]
        assert scale > 0.05 and e < 1e-4, (name, second[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_loaded_stages_are_captured_in_the_graphs(tmp_path):
    from tools.make_tiny_checkpoints import make_pi0

    ckpt = make_pi0(tmp_path / "pi0", SPEC, variant="pi0", chunk_size=CHUNK)
    folder = tmp_path / "aot"
    first = _serve(ckpt, folder, tmp_path / "cache_a", "first", "cuda")
    second = _serve(ckpt, folder, tmp_path / "cache_b", "again", "cuda")
    assert first["vision"][1] >= 1 and first["prefix"][1] >= 1 and first["vision"][2] == first["prefix"][2] == 0
    assert second["vision"][1] == second["prefix"][1] == 0 and second["vision"][0] >= 1, second
    for name in ("b3", "b1", "b5_long", "new_weights"):
        e, scale = second[name]
        assert e < 0.05 * scale + 1e-2, (name, second[name])  # bf16 against lerobot's float path
