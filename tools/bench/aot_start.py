"""What ahead-of-time compilation would save at start-up, against today's shipped compile
artefacts, on a stand-in of a served model's depth: transformers' Llama decoder stack (the layer
loop OpenVLA-OFT's fast path compiles; ``--depth`` 32, narrow widths, so that what is measured
is the host's work, not the arithmetic), the layers called with the model as an argument.

Each case is a fresh process; the first compiled call (compile or load included) is timed:

- ``cold``: an empty inductor cache (compiles), saving what it compiled as portable artefacts
  (``torch.compiler.save_cache_artifacts``: what ``inference.compile_artifacts`` ships);
- ``warm``: that cache again (a restart): dynamo traces, inductor reads its cache;
- ``artefacts``: an empty cache given the artefacts first (a new machine, as Tandem does today);
- ``aot_save``: an empty cache, ``torch.compile(...).aot_compile`` (dynamo, AOTAutograd and
  inductor ahead of time), the result saved with ``save_compiled_function``;
- ``aot``: an empty cache loading that file with ``torch.compiler.load_compiled_function`` (a
  new machine given the compiled function: no tracing); ``aot_warm``: the same on ``cold``'s cache.

Every result is checked against the eager layers (``max_diff``); on a CPU, inductor's CPU ISA
probe (~15-25 s, a CPU-only cost) is paid and timed apart before the clock starts. The repeats
interleave the cases.

    python -m tools.bench.aot_start --device cpu --repeats 2 --json out.json
    python -m tools.bench.aot_start --device cuda --json out.json    # GPU box
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import ROOT, emit_json, median

#: (case, inductor cache: "a" the shared one, "new" an empty one per process)
CASES = (("cold", "a"), ("warm", "a"), ("artefacts", "new"), ("aot_save", "new"), ("aot", "new"), ("aot_warm", "a"))


def layers(lm, x, mask, pos):
    """The decoder stack as OFT's fast path runs it (positions, rotary, each layer, the norm)."""
    pe = lm.rotary_emb(x, pos)
    for layer in lm.layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return lm.norm(x)


def child(a) -> None:
    import torch

    torch.set_num_threads(1)
    torch._dynamo.config.enable_aot_compile = True
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    isa = 0.0
    if a.device == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        t = time.perf_counter()
        pick_vec_isa()
        isa = time.perf_counter() - t
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.width, intermediate_size=2 * a.width, num_hidden_layers=a.depth,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128, attn_implementation="sdpa")
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    lm = LlamaModel(cfg).to(a.device, dtype).eval()
    x = torch.randn(2, 40, a.width, device=a.device, dtype=dtype)
    mask = torch.zeros(2, 1, 40, 40, device=a.device, dtype=dtype)
    pos = torch.arange(40, device=a.device)[None]
    files = Path(a.files)
    with torch.no_grad():
        ref = layers(lm, x, mask, pos)
        t0 = time.perf_counter()
        if a.case == "artefacts":
            torch.compiler.load_cache_artifacts((files / "mega.bin").read_bytes())
        if a.case in ("aot", "aot_warm"):
            with open(files / "layers.aot", "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
        elif a.case == "aot_save":
            fn = torch.compile(layers, fullgraph=True).aot_compile(((lm, x, mask, pos), {}))
        else:
            fn = torch.compile(layers, fullgraph=True)
        out = fn(lm, x, mask, pos)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        if a.case == "cold":
            art, _ = torch.compiler.save_cache_artifacts()
            (files / "mega.bin").write_bytes(art)
        if a.case == "aot_save":
            fn.save_compiled_function(str(files / "layers.aot"))
    print(json.dumps({"first_call_s": first, "isa_probe_s": isa, "max_diff": float((out - ref).abs().max())}))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--depth", type=int, default=32, help="decoder layers (Llama-2-7B: 32)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        child(a)
        return {}
    res: dict = {"device": a.device, "depth": a.depth, "width": a.width, "runs": []}
    for rep in range(a.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            n = 0
            for case, cache in CASES:
                n += 1
                folder = Path(tmp) / ("inductor" if cache == "a" else f"inductor_{n}")
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder),
                           PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
                cmd = [sys.executable, "-m", "tools.bench.aot_start", "--child", "--case", case, "--files", tmp,
                       "--device", a.device, "--depth", str(a.depth), "--width", str(a.width)]
                r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode != 0:
                    raise SystemExit(f"aot_start: case {case} failed:\n{r.stderr[-3000:]}")
                out = {"case": case, "repeat": rep, **json.loads(r.stdout.strip().splitlines()[-1])}
                res["runs"].append(out)
                print(f"rep {rep} {case:9s} first call {out['first_call_s']:.2f} s (max diff {out['max_diff']:.2g})",
                      file=sys.stderr, flush=True)
    res["first_call_s"] = {c: median([r["first_call_s"] for r in res["runs"] if r["case"] == c]) for c, _ in CASES}
    if a.json:
        emit_json(res, a.json)
    return res


if __name__ == "__main__":
    main()
