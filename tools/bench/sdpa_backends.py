"""Each SDPA backend alone at PI0's attention shapes: which ones take the call, and how long.

    python -m tools.bench.sdpa_backends [--json out.json]

For the prefix pass (8 query heads over 616 keys at head dimension 256, an additive bf16 mask,
the key/value head repeated or shared through ``enable_gqa``, and without a mask for reference)
and SigLIP (16 heads, 256 tokens, head dimension 72, no mask) at batch 1 and 8 (2 and 16 images),
runs ``scaled_dot_product_attention`` under ``sdpa_kernel([backend])`` for cuDNN, flash and the
memory-efficient kernel and reports the mean time of 50 calls (CUDA events) or SDPA's reason
for refusing. Needs a GPU. What it is for: choosing the prefix's attention kernel
(``FastPiSampler(prefix_attention=...)``, agents/policies/pi0/fast.py) from figures, not from
SDPA's backend order.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
import torch.nn.functional as F

CALLS = 50


def case(b: int, h: int, hkv: int, length: int, d: int, mask: str | None, gqa: bool = False) -> dict[str, object]:
    """{backend: microseconds per call, or the refusal's text} for one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    m = None
    if mask == "float":
        m = torch.zeros(b, 1, length, length, device="cuda", dtype=torch.bfloat16)
        m[..., -5:] = torch.finfo(torch.bfloat16).min
    out: dict[str, object] = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(CALLS):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
                    end.record()
                    torch.cuda.synchronize()
                out[backend.name] = round(start.elapsed_time(end) / CALLS * 1000, 1)
            except RuntimeError as e:
                reasons = [str(w.message).split(" (Triggered")[0] for w in said if "not" in str(w.message)]
                out[backend.name] = "refused: " + ("; ".join(reasons) or str(e))[:300]
    return out


SHAPES = {  # name -> (b, heads, kv heads, tokens, head dim, mask, gqa)
    "prefix b1, mask, kv repeated": (1, 8, 8, 616, 256, "float", False),
    "prefix b1, mask, gqa": (1, 8, 1, 616, 256, "float", True),
    "prefix b1, no mask": (1, 8, 8, 616, 256, None, False),
    "siglip 2 images": (2, 16, 16, 256, 72, None, False),
    "prefix b8, mask, kv repeated": (8, 8, 8, 616, 256, "float", False),
    "prefix b8, mask, gqa": (8, 8, 1, 616, 256, "float", True),
    "prefix b8, no mask": (8, 8, 8, 616, 256, None, False),
    "siglip 16 images": (16, 16, 16, 256, 72, None, False),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sdpa_backends: needs a GPU", file=sys.stderr)
        return 2
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
           "us_per_call": {}}
    for name, shape in SHAPES.items():
        res["us_per_call"][name] = r = case(*shape)
        print(f"{name:30s} " + "  ".join(f"{k}: {v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
