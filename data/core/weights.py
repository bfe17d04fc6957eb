"""The weight-snapshot wire format: trainable tensors as plain numeric arrays.

bfloat16 (which numpy lacks) travels as its raw 16-bit pattern with the tensor's name in
the message's ``bf16`` list. Nothing is unpickled: arrays come back through the codec.
"""

from __future__ import annotations

import numpy as np
import torch


def to_wire(state: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Tensors -> (numpy arrays on the CPU, names of the bfloat16 ones)."""
    arrays, bf16 = {}, []
    for k, t in state.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arrays[k] = t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy()
            bf16.append(k)
        else:
            arrays[k] = t.numpy()
    return arrays, bf16


def from_wire(arrays: dict[str, np.ndarray], bf16: list[str] | tuple = ()) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_wire` (copies: wire buffers are read-only)."""
    out = {}
    for k, a in arrays.items():
        t = torch.from_numpy(np.array(a))
        out[k] = t.view(torch.bfloat16) if k in bf16 else t
    return out
