"""The serving copy's warm-up: compile and capture its batch buckets before they are served.

A policy with ``warm_up(batch_sizes=..., max_batch=...)`` (PI0 / PI0.5 and OFT's fast paths:
each bucket's CUDA graphs, compiled and captured; ``{bucket: seconds}`` back) is warmed up on the
serving device, under the server's autocast and inside ``torch.random.fork_rng`` (its acts draw
from the global RNG; the state is put back). Two ways (``inference.warmup``):

- ``all``: every bucket (the policy's ``cfg.fast_warmup_buckets`` up to ``max_batch``) before
  the server is built, so no act ever waits for a compile;
- ``staged`` (the default): only the smallest bucket before the server is built, so the learner
  serves as soon as one graph is ready; the server then gathers at most that many rows per batch
  (:attr:`Warmup.cap`) and warms the next bucket on its own thread, one at a time, whenever it
  is idle or a batch was cut by the cap. The acts of a start-up burst are served in small
  batches, and those that arrive while a bucket compiles wait for it, once per bucket (actors
  hold their envs through the wait as through any pause of the learner).

With ``compile_artifacts`` (a folder: ``inference.compile_artifacts``) this GPU's and torch's
portable compile artefacts are loaded before the first bucket and what the warm-up compiled is
saved there after the last (:mod:`agents.policies.fast_common`); a policy whose ahead-of-time path
is on by default (``AOT_BY_DEFAULT``: OpenVLA-OFT; PI0's, ``policy.fast_aot_dir``, is opt-in until it
is measured on a GPU) and has no folder of its own set keeps its functions in ``<folder>/aot``
(:mod:`agents.policies.fast_aot`), so shipping the one folder ships both. A policy whose ``warm_up``
takes no ``batch_sizes`` or that lists no buckets is warmed all at once. A failed warm-up is
logged and serving goes on (graphs are then built on first use).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time

import torch

log = logging.getLogger(__name__)

WARMUPS = ("all", "staged")


def default_aot_dir(policy, folder: str) -> None:
    """``policy.cfg.fast_aot_dir`` = ``<folder>/aot`` where the policy has that setting and its
    ``AOT_BY_DEFAULT`` is true, none is set and its fast path is not built yet (the module docstring)."""
    cfg = getattr(policy, "cfg", None)
    if (cfg is None or not getattr(policy, "AOT_BY_DEFAULT", False) or not hasattr(cfg, "fast_aot_dir")
            or cfg.fast_aot_dir or "_fast" in vars(policy)):
        return
    cfg.fast_aot_dir = os.path.join(os.path.expanduser(str(folder)), "aot")
    log.info("ahead-of-time functions of the serving copy: %s", cfg.fast_aot_dir)


class Warmup:
    def __init__(self, policy, *, device: torch.device, max_batch: int, autocast_dtype: torch.dtype | None = None,
                 compile_artifacts: str | None = None, mode: str = "staged"):
        if mode not in WARMUPS:
            raise ValueError(f"inference.warmup must be one of {', '.join(WARMUPS)}, got {mode!r}")
        self.policy, self.device, self.max_batch = policy, device, int(max_batch)
        self.autocast_dtype, self.compile_artifacts = autocast_dtype, compile_artifacts or None
        fn = getattr(policy, "warm_up", None)
        self._fn = fn if callable(fn) else None
        #: the batch sizes still to warm, smallest first (empty: done, or warmed all at once)
        self.todo: list[int] = self._stages() if mode == "staged" and self._fn is not None else []
        self.mode = mode if self.todo else "all"
        #: {bucket: seconds} warmed so far
        self.buckets: dict[int, float] = {}
        #: seconds from the first bucket's start to the last bucket ready (None until then)
        self.total_s: float | None = None
        self._t0: float | None = None

    def _stages(self) -> list[int]:
        try:
            takes_sizes = "batch_sizes" in inspect.signature(self._fn).parameters
        except (TypeError, ValueError):
            takes_sizes = False
        sizes = getattr(getattr(self.policy, "cfg", None), "fast_warmup_buckets", None)
        if not takes_sizes or not sizes:
            return []
        return sorted({int(b) for b in sizes if 1 <= int(b) <= self.max_batch})

    @property
    def pending(self) -> bool:
        """Buckets are left to warm (staged)."""
        return bool(self.todo)

    @property
    def cap(self) -> int:
        """The most rows a batch should gather now: the largest warmed bucket while buckets are
        left (a batch above it would compile on first use), else ``max_batch``."""
        if not self.todo:
            return self.max_batch
        return max(max(self.buckets, default=1), 1)

    def stats(self) -> dict:
        """For status.json: the mode, {bucket: seconds} warmed, the sizes still to warm, the cap
        on a batch's rows now and the whole warm-up's seconds (None until it is done)."""
        return {"mode": self.mode, "buckets_s": {str(b): round(t, 3) for b, t in sorted(self.buckets.items())},
                "to_warm": list(self.todo), "cap": self.cap, "total_s": self.total_s}

    def start(self) -> dict[int, float]:
        """Before the server is built: load the artefacts, warm the first bucket (staged) or all."""
        if self._fn is None:
            return self.buckets
        self._t0 = time.perf_counter()
        if self.compile_artifacts:
            from agents.policies.fast_common import load_compile_artifacts
            load_compile_artifacts(self.compile_artifacts, self.device)
            default_aot_dir(self.policy, self.compile_artifacts)
        if self.todo:
            self.next()
        else:
            self._run({})
            self._finish()
        return self.buckets

    def next(self) -> None:
        """Warm the next bucket (staged; the server's thread calls it between batches)."""
        if not self.todo:
            return
        # (popped once warmed: ``pending`` stays true while the last bucket is being captured)
        if self._run({"batch_sizes": [self.todo[0]]}):
            self.todo.pop(0)
        else:
            # it failed (the rest are built on first use), or the policy captures nothing here
            # (a CPU, fast serving off): nothing to stage
            self.todo.clear()
        if not self.todo:
            self._finish()

    def _run(self, kw: dict) -> bool:
        """The policy's warm_up with ``kw``; whether it warmed anything."""
        cuda = self.device.type == "cuda"
        try:
            with torch.random.fork_rng(devices=[self.device] if cuda else []), \
                    (torch.cuda.device(self.device) if cuda else contextlib.nullcontext()), \
                    (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                     else contextlib.nullcontext()):
                out = self._fn(max_batch=self.max_batch, **kw) or {}
        except Exception:  # noqa: BLE001 - a warm-up must not stop the learner
            log.exception("policy warm-up failed; graphs will be built on first use")
            return False
        self.buckets.update({int(k): float(v) for k, v in out.items()})
        if out and len(self.todo) > 1:
            log.info("serving warm-up: batch sizes %s ready, %s to come (batches capped at %d meanwhile)",
                     sorted(self.buckets), self.todo[1:], self.cap)
        return bool(out)

    def _finish(self) -> None:
        self.total_s = time.perf_counter() - self._t0 if self._t0 is not None else None
        if self.buckets:
            log.info("serving warm-up: batch sizes %s ready in %.1f s", sorted(self.buckets), self.total_s or 0.0)
        if self.compile_artifacts:
            from agents.policies.fast_common import save_compile_artifacts
            try:
                save_compile_artifacts(self.compile_artifacts, self.device)
            except OSError as exc:
                log.warning("compile artefacts not saved to %s: %s", self.compile_artifacts, exc)
