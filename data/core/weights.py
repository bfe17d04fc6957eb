"""The weight-snapshot wire format: trainable tensors as plain numeric arrays, sealed.

bfloat16 (which numpy lacks) travels as its raw 16-bit pattern with the tensor's name in
the message's ``bf16`` list. Nothing is unpickled: arrays come back through the codec.

Every snapshot carries its own integrity record: one more array, :data:`DIGEST_KEY`, a
16-byte BLAKE2b digest over each tensor's name, dtype, shape, bf16 flag and bytes, in name
order. It travels inside the arrays, so every path that carries a snapshot (the PUB
broadcast, a ``get_weights`` reply) carries it too. :func:`from_wire` refuses a snapshot
whose digest is missing or does not match (a truncated, corrupted or re-assembled one) and,
given the receiving policy's own state (``expect``), one whose tensors are not exactly the
policy's (missing, extra, other shapes or dtypes): a partial snapshot is refused whole,
before ``load_state_dict`` could apply half of it. (ZeroMQ already delivers a multipart
message whole or not at all, so a link cut mid-snapshot never reaches the application; the
digest covers what that does not: corruption, a sender bug, a partial state dict.)
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import numpy as np
import torch

#: reserved array name of a snapshot's digest (uint8[16])
DIGEST_KEY = "snapshot.digest"
DIGEST_BYTES = 16


class SnapshotError(ValueError):
    """A weight snapshot that must not be loaded: names what is wrong."""


def snapshot_digest(arrays: Mapping[str, np.ndarray], bf16=()) -> np.ndarray:
    """The digest (uint8[16]) of the snapshot's tensors (``DIGEST_KEY`` itself excluded)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name in sorted(k for k in arrays if k != DIGEST_KEY):
        a = np.ascontiguousarray(arrays[name])
        h.update(repr((name, a.dtype.str, tuple(a.shape), name in bf16)).encode())
        h.update(a.reshape(-1).view(np.uint8))
    return np.frombuffer(h.digest(), np.uint8).copy()


def digest_hex(arrays: Mapping[str, np.ndarray]) -> str:
    """The snapshot's digest as hex ('' when it has none), for logs."""
    d = arrays.get(DIGEST_KEY)
    return bytes(np.asarray(d, np.uint8)).hex() if d is not None else ""


def to_wire(state: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Tensors -> (numpy arrays on the CPU plus ``DIGEST_KEY``, names of the bfloat16 ones)."""
    arrays, bf16 = {}, []
    for k, t in state.items():
        if k == DIGEST_KEY:
            raise SnapshotError(f"a tensor may not be named {DIGEST_KEY!r} (reserved)")
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arrays[k] = t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy()
            bf16.append(k)
        else:
            arrays[k] = t.numpy()
    arrays[DIGEST_KEY] = snapshot_digest(arrays, bf16)
    return arrays, bf16


def verify(arrays: Mapping[str, np.ndarray], bf16=()) -> None:
    """Raise :class:`SnapshotError` unless the snapshot's digest is there and matches."""
    if not isinstance(bf16, (list, tuple)) or not all(isinstance(k, str) for k in bf16):
        raise SnapshotError(f"the bf16 list must be a list of tensor names, got {type(bf16).__name__}")
    unknown = [k for k in bf16 if k not in arrays]
    if unknown:
        raise SnapshotError(f"bf16 names tensors the snapshot does not have: {unknown[:5]}")
    d = arrays.get(DIGEST_KEY)
    if d is None:
        raise SnapshotError(f"the snapshot has no digest ({DIGEST_KEY!r}): refusing it unverified")
    d = np.asarray(d)
    if d.dtype != np.uint8 or d.shape != (DIGEST_BYTES,):
        raise SnapshotError(f"the snapshot's digest must be uint8[{DIGEST_BYTES}], got "
                            f"{d.dtype}{tuple(d.shape)}")
    got = snapshot_digest(arrays, bf16)
    if not np.array_equal(got, d):
        raise SnapshotError(f"the snapshot's digest does not match its {len(arrays) - 1} tensors "
                            f"(sent {bytes(d).hex()[:12]}, computed {bytes(got).hex()[:12]}): "
                            "truncated or corrupted")


def from_wire(arrays: Mapping[str, np.ndarray], bf16: list[str] | tuple = (), *,
              expect: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_wire` (copies: wire buffers are read-only), after :func:`verify`.

    ``expect`` (the receiving policy's trainable state, or anything with ``.shape`` and
    ``.dtype`` per name): the snapshot must hold exactly these tensors, each of that shape
    and dtype; else :class:`SnapshotError` and nothing is returned to load."""
    verify(arrays, bf16)
    out = {}
    for k, a in arrays.items():
        if k == DIGEST_KEY:
            continue
        t = torch.from_numpy(np.array(a))
        out[k] = t.view(torch.bfloat16) if k in bf16 else t
    if expect is not None:
        check_matches(out, expect)
    return out


def check_matches(state: Mapping[str, torch.Tensor], expect: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`SnapshotError` unless ``state`` has exactly ``expect``'s names, shapes
    and dtypes."""
    missing = sorted(set(expect) - set(state))
    extra = sorted(set(state) - set(expect))
    if missing or extra:
        raise SnapshotError(f"the snapshot's tensors are not the policy's: {len(missing)} missing "
                            f"{missing[:3]}, {len(extra)} unexpected {extra[:3]}")
    for k, ref in expect.items():
        t = state[k]
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            raise SnapshotError(f"tensor {k!r} is {t.dtype}{tuple(t.shape)}, the policy's is "
                                f"{ref.dtype}{tuple(ref.shape)}")
