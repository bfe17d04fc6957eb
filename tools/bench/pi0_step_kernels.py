"""The step layers' Triton kernels alone against what they replace, at PI0's expert shapes.

    python -m tools.bench.pi0_step_kernels [--batches 1,8] [--sweep] [--json out.json]
    python -m tools.bench.pi0_step_kernels --tiles-from out.json   # the sweep's winners, as
                                                                   # TANDEM_PI0_STEP_TILES JSON

For each kernel of :mod:`agents.policies.pi0.fast_step_kernels` (``qkv``: RMS norm + q/k/v +
rotary, k and v written into the step buffers; ``gate_up``: RMS norm + gate/up + gelu x up;
``o_residual`` / ``down_residual``: a projection + the residual, o_proj reading attention's
[B, H, S, D] output where the reference first copies it to [B, S, H, D]) and its reference (the same arithmetic in torch, compiled as the fast
path compiles the unfused step: cuBLAS GEMMs over the stacked weights, inductor's kernels around
them), at PI0's action expert (width 1024, 8 query heads and 1 key/value head of 256, MLP 4096,
51 suffix rows per observation) and each batch: microseconds per call, the mean of 50 calls
replayed in a CUDA graph (what serving runs), with the time it takes to read the kernel's weights
once at the copy bandwidth measured in the same run. ``--sweep`` also times each kernel over a grid
of tiles (rows, columns, reduction step, warps, stages) and reports the best; the winners go in
``fast_step_kernels.TILES`` (or ``TANDEM_PI0_STEP_TILES``). Needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

CALLS = 50
WIDTH, HEADS, KV_HEADS, HEAD_DIM, MLP, SUFFIX, EPS = 1024, 8, 1, 256, 4096, 51, 1e-6
KEYS = 624  # the step buffers' length: 51 suffix + ~570 prefix tokens, a multiple of 8


def graph_us(fn, calls: int = CALLS, reps: int = 5) -> float:
    """Mean microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return round(best, 2)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), calls=5)
    return 2 * a.numel() * 2 / (us * 1e-6)


def _rms(x, w):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + EPS) * (1 + w.float())).to(x.dtype)


def cases(batch: int) -> dict:
    """name -> (reference fn, kernel fn, weight bytes), over random bf16 tensors of one batch."""
    from agents.policies.pi0 import fast_step_kernels as kernels

    dev, dt = "cuda", torch.bfloat16
    m, half = batch * SUFFIX, HEAD_DIM // 2

    def r(*shape, scale=0.02):
        return torch.randn(*shape, device=dev, dtype=dt) * scale

    x, n1, n2 = r(m, WIDTH, scale=1.0), r(WIDTH), r(WIDTH)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w_qkv, w_o, w_gu, w_d = r(qkv_rows, WIDTH), r(WIDTH, HEADS * HEAD_DIM), r(2 * MLP, WIDTH), r(WIDTH, MLP)
    cos, sin = r(m, HEAD_DIM, scale=1.0), r(m, HEAD_DIM, scale=1.0)
    # attention's output as its GEMM writes it [B, H, S, D]; the step buffers [B, Hkv, keys, D]
    attn, act = r(batch, HEADS, SUFFIX, HEAD_DIM, scale=1.0), r(m, MLP, scale=1.0)
    kbuf, vbuf = r(batch, KV_HEADS, KEYS, HEAD_DIM), r(batch, KV_HEADS, KEYS, HEAD_DIM)

    def ref_qkv(kb, vb):
        h = F.linear(_rms(x, n1), w_qkv).view(batch, SUFFIX, -1, HEAD_DIM).transpose(1, 2)
        q, k, v = h.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        c, s = cos.view(batch, 1, SUFFIX, HEAD_DIM), sin.view(batch, 1, SUFFIX, HEAD_DIM)

        def rot(t):
            return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s

        kb[:, :, :SUFFIX] = rot(k)
        vb[:, :, :SUFFIX] = v
        return rot(q)

    def ref_gate_up():
        g, u = F.linear(_rms(x, n2), w_gu).chunk(2, dim=-1)
        return F.gelu(g, approximate="tanh") * u

    o_in = attn.transpose(1, 2)  # what the unfused path copies to [B, S, H, D] before o_proj
    comp = {name: torch.compile(fn, dynamic=False) for name, fn in
            (("qkv", ref_qkv), ("gate_up", ref_gate_up),
             ("o_residual", lambda: x + F.linear(o_in.reshape(m, -1), w_o)),
             ("down_residual", lambda: x + F.linear(act, w_d)))}
    qkv_ref = comp["qkv"]
    comp["qkv"] = lambda: qkv_ref(kbuf, vbuf)
    nbytes = {"qkv": w_qkv, "gate_up": w_gu, "o_residual": w_o, "down_residual": w_d}
    kern = {"qkv": lambda: kernels.qkv_rope(x, w_qkv, cos, sin, kbuf, vbuf, SUFFIX, HEADS, EPS),
            "gate_up": lambda: kernels.gate_up(x, w_gu, EPS),
            "o_residual": lambda: kernels.linear_residual(attn, w_o, x),
            "down_residual": lambda: kernels.linear_residual(act, w_d, x)}
    return {n: (comp[n], kern[n], nbytes[n].numel() * 2, TILE_OF[n]) for n in kern}


def sweep_grid(batch: int) -> list[tuple[int, int, int, int, int]]:
    """The first pass's tiles (3 pipeline stages): rows 32 / 64 at batch 1 (51 rows), 64 / 128
    beyond; 4 warps, and 8 for blocks of 128 rows."""
    rows = (32, 64) if batch == 1 else (64, 128)
    return [(bm, bn, bk, w, 3) for bm, bn, bk in itertools.product(rows, (16, 32, 64), (64, 128, 256))
            for w in ((4, 8) if bm >= 128 else (4,))]


def sweep(kern, tile: str, batch: int, row: dict) -> None:
    """Time ``kern`` over :func:`sweep_grid`, then the best two with 2 and 4 stages; the five
    fastest go in ``row["sweep_best"]`` ([us, tiles]), tiles that fail in ``row["refused"]``."""
    from agents.policies.pi0 import fast_step_kernels as kernels

    def run(tiles) -> list:
        out = []
        for t in tiles:
            kernels.TILES[tile] = t
            try:
                out.append((graph_us(kern, reps=3), t))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                row.setdefault("refused", []).append([list(t), str(e)[:120]])
        return out

    timed = sorted(run(sweep_grid(batch)))
    timed = sorted(timed + run([(*t[:4], st) for _, t in timed[:2] for st in (2, 4)]))
    row["sweep_best"] = [[us, list(t)] for us, t in timed[:5]]


#: the tile key each kernel's sweep tunes (``o_residual`` and ``down_residual`` share one)
TILE_OF = {"qkv": "qkv", "gate_up": "gate_up", "o_residual": "residual", "down_residual": "residual"}


def best_tiles(res: dict) -> dict[str, list[int]]:
    """The sweep's winners in ``TANDEM_PI0_STEP_TILES`` form: per tile key (``<kernel>`` at
    batch 1, ``<kernel>@batch`` beyond), the fastest tile that beat the kernel's default time;
    for the two residual kernels, the tile with the least time summed over both among those
    both timed (else the down projection's, the larger). Keys whose default won are left out."""
    from agents.policies.pi0 import fast_step_kernels as kernels

    out: dict[str, list[int]] = {}
    for b, rows in res.get("batches", {}).items():
        suffix = "" if int(b) * SUFFIX <= kernels.ONE_OBSERVATION_ROWS else "@batch"
        by_key: dict[str, list[tuple[str, dict]]] = {}
        for name, row in rows.items():
            if row.get("sweep_best"):
                by_key.setdefault(TILE_OF[name] + suffix, []).append((name, row))
        for key, named in by_key.items():
            times = [{tuple(t): us for us, t in row["sweep_best"]} for _, row in named]
            common = set.intersection(*(set(t) for t in times))
            if len(named) > 1 and common:
                tile = min(common, key=lambda t: sum(tt[t] for tt in times))
                won = sum(tt[tile] for tt in times) < sum(row["kernel_us"] for _, row in named)
            else:
                name, row = max(named, key=lambda nr: nr[1]["weights_read_us"])
                us, tile = min((us, tuple(t)) for us, t in row["sweep_best"])
                won = us < row["kernel_us"]
            if won:
                out[key] = list(tile)
    return out


def main(argv: list[str] | None = None) -> int:
    from agents.policies.pi0 import fast_step_kernels as kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--sweep", action="store_true", help="time each kernel over a grid of tiles")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--tiles-from", metavar="JSON",
                    help="print the winners of a --sweep run's JSON as TANDEM_PI0_STEP_TILES (no GPU needed)")
    args = ap.parse_args(argv)
    if args.tiles_from:
        with open(args.tiles_from) as f:
            print(json.dumps(best_tiles(json.load(f))))
        return 0
    if not torch.cuda.is_available():
        print("pi0_step_kernels: needs a GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": round(bw / 1e9),
           "tiles": {k: list(v) for k, v in kernels.TILES.items()}, "batches": {}}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; tiles {kernels.TILES}")
    default_tiles = dict(kernels.TILES)
    for b in [int(x) for x in args.batches.split(",") if x]:
        out = res["batches"][str(b)] = {}
        for name, (ref, kern, nbytes, tile) in cases(b).items():
            tile = tile if b * SUFFIX <= kernels.ONE_OBSERVATION_ROWS else f"{tile}@batch"
            kernels.TILES.update(default_tiles)
            row = out[name] = {"reference_us": graph_us(ref), "kernel_us": graph_us(kern),
                               "weights_read_us": round(nbytes / bw * 1e6, 2)}
            if args.sweep:
                sweep(kern, tile, b, row)
            kernels.TILES.update(default_tiles)
            print(f"batch {b} {name:14s} " + "  ".join(f"{k}: {v}" for k, v in row.items() if k != "refused"),
                  flush=True)
            if args.json:  # after every kernel: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
