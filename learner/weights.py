"""Versioned weight snapshots: only the trainable tensors, latest wins; never one holding a
NaN or an infinity (refused and counted: the last good version keeps serving).

``publish`` hands a snapshot to the inference thread (its serving copy) and broadcasts it on
the PUB socket; ``latest`` serves ``get_weights`` requests. Tensors travel as plain numeric
arrays; bfloat16 (which numpy lacks) travels as its raw uint16 bits with a dtype note. Each
snapshot is sealed with its digest (:data:`data.core.weights.DIGEST_KEY`, one more array), so
an actor verifies what it loads whichever path brought it (broadcast or ``get_weights``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np
import torch

from data.core.codec import encode
from data.core.weights import digest_hex, to_wire
from learner.finite_guard import nonfinite

log = logging.getLogger("tandem.learner.weights")


class WeightPublisher:
    def __init__(self, to_inference: Callable[[int, dict], None], to_pub: Callable[[list], None]):
        self.to_inference = to_inference
        self.to_pub = to_pub
        self.version = 0
        self._latest: tuple[int, dict[str, np.ndarray], list[str]] | None = None
        self._lock = threading.Lock()
        self.last_nbytes = 0
        self.last_digest = ""
        #: snapshots refused because a tensor held a NaN or an infinity (never served, sent
        #: or checkpointed: the last good version stays)
        self.refused = 0
        self.last_refused: list[str] = []

    def publish(self, state: dict[str, torch.Tensor], version: int | None = None) -> int | None:
        """Hand ``state`` to serving and the broadcast as the next version (or ``version``);
        returns the version, or None when a tensor is not finite (refused, counted, logged:
        serving and the actors keep the last good version)."""
        bad = nonfinite(state)
        if bad:
            self.refused += 1
            self.last_refused = bad[:10]
            log.error("weights not published: %d tensor(s) hold NaN or Inf (%s%s); serving keeps "
                      "version %d (%d refused so far)", len(bad), ", ".join(bad[:5]),
                      ", ..." if len(bad) > 5 else "", self.version, self.refused)
            return None
        with self._lock:
            self.version = self.version + 1 if version is None else int(version)
            arrays, bf16 = to_wire(state)
            self._latest = (self.version, arrays, bf16)
            self.last_nbytes = sum(a.nbytes for a in arrays.values())
            self.last_digest = digest_hex(arrays)
        self.to_inference(self.version, {k: v.clone() for k, v in state.items()})
        self.to_pub(encode("weights", {"policy_version": self.version, "bf16": bf16}, arrays))
        return self.version

    def latest(self):
        with self._lock:
            if self._latest is None:
                return None
            version, arrays, bf16 = self._latest
            return version, arrays, bf16
