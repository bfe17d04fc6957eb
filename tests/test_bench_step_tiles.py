"""tools/bench/pi0_step_kernels.py --tiles-from: the sweep's winners as TANDEM_PI0_STEP_TILES,
which agents/policies/pi0/fast_step_kernels.py reads at import (no GPU needed for either)."""

from __future__ import annotations

import json

from tandem_testutil import python_code
from tools.bench.pi0_step_kernels import best_tiles, main


def _row(kernel_us, best, weights_us=5.0):
    return {"reference_us": 20.0, "kernel_us": kernel_us, "weights_read_us": weights_us,
            "sweep_best": [[us, list(t)] for us, t in best]}


A, B, C = (32, 16, 128, 4, 3), (64, 32, 64, 4, 2), (32, 32, 256, 4, 4)

SWEEP = {"batches": {
    "1": {"qkv": _row(10.0, [(8.0, A), (9.0, B)]),             # A beats the default: chosen
          "gate_up": _row(7.0, [(7.5, B)]),                    # the default was faster: left out
          # the residual kernels share a tile: C has the least time over both (4 + 9 < 3 + 11)
          "o_residual": _row(6.0, [(3.0, A), (4.0, C)], weights_us=2.0),
          "down_residual": _row(12.0, [(9.0, C), (11.0, A)], weights_us=8.0)},
    "8": {"qkv": _row(30.0, [(25.0, B)]),
          # one of the pair swept: the larger kernel's best
          "down_residual": _row(40.0, [(35.0, A)], weights_us=8.0)}}}


def test_the_sweep_s_winners_per_tile_key_and_only_where_they_beat_the_default():
    assert best_tiles(SWEEP) == {"qkv": list(A), "residual": list(C), "qkv@batch": list(B),
                                 "residual@batch": list(A)}
    assert best_tiles({"batches": {"1": {"qkv": {"kernel_us": 1.0, "weights_read_us": 1.0}}}}) == {}


def test_the_printed_tiles_are_what_the_kernels_module_loads(tmp_path, capsys):
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps(SWEEP))
    assert main(["--tiles-from", str(f)]) == 0
    tiles = capsys.readouterr().out.strip()
    loaded = python_code(
        "import json\nfrom agents.policies.pi0 import fast_step_kernels as k\n"
        "print(json.dumps({n: list(v) for n, v in k.TILES.items()}))",
        triton_interpret=False, env={"TANDEM_PI0_STEP_TILES": tiles})
    got = json.loads(loaded.strip().splitlines()[-1])
    assert got["qkv"] == list(A) and got["residual@batch"] == list(A) and got["gate_up"] != list(B)
