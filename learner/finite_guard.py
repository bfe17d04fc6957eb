"""No non-finite update reaches the learner's weights.

:class:`GuardedAccelerator` is the learner's ``Accelerator`` (:func:`learner.distributed.make_accelerator`):
every optimizer it prepares gets a step pre-hook, and every ``backward`` it runs reports its
loss to a :class:`FiniteGuard`. A step whose loss (since the last step) or whose gradients are
not finite is skipped: the hook clears the optimizer's gradients, so ``step`` changes no
parameter and no moment (Adam skips parameters without a gradient), and the skip is counted
by reason (``skipped``: ``loss`` / ``gradient``). One backward followed by several steps (PPO's
policy and value optimizers; SAC's actor and temperature) skips them all.

With several ranks only the gradient decides (it is all-reduced, the same on every rank, so
every rank skips the same steps); a rank's own loss would not be. DeepSpeed engines step inside
their own ``backward``/``step`` and skip overflowing fp16/bf16 steps themselves; they are not
hooked here (the learner's publish and checkpoint gates still hold).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from accelerate import Accelerator


class FiniteGuard:
    def __init__(self, *, check_loss: bool = True, on_skip: Callable[[str], None] | None = None):
        self.check_loss = check_loss
        self.on_skip = on_skip
        #: skipped optimizer steps by reason: "loss" (a non-finite loss), "gradient"
        self.skipped: Counter[str] = Counter()
        self._bad_loss = False
        self._stepped = False

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def on_backward(self, loss: torch.Tensor) -> None:
        if self._stepped:  # a new update's first backward
            self._bad_loss = self._stepped = False
        if self.check_loss and not bool(torch.isfinite(loss.detach()).all()):
            self._bad_loss = True

    def watch(self, optimizer) -> None:
        """Hook ``optimizer`` (an accelerate-wrapped one: its inner torch optimizer)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer) and not getattr(inner, "_tandem_guarded", False):
            inner.register_step_pre_hook(self.pre_step)
            inner._tandem_guarded = True

    def pre_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self._stepped = True
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        reason = "loss" if self._bad_loss else None
        if reason is None and params:
            # the largest |gradient| (no overflow, unlike a 2-norm): NaN or inf if any is
            worst = torch.nn.utils.get_total_norm([p.grad for p in params], float("inf"))
            if not bool(torch.isfinite(worst)):
                reason = "gradient"
        if reason is None:
            return
        for p in params:
            p.grad = None
        self.skipped[reason] += 1
        if self.on_skip is not None:
            self.on_skip(reason)


class GuardedAccelerator(Accelerator):
    """An ``Accelerator`` whose prepared optimizers skip non-finite steps (:class:`FiniteGuard`,
    as ``finite_guard``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finite_guard = FiniteGuard(check_loss=self.num_processes == 1)

    def prepare(self, *args, **kwargs):
        out = super().prepare(*args, **kwargs)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, torch.optim.Optimizer):
                self.finite_guard.watch(obj)
        return out

    def backward(self, loss, **kwargs):
        self.finite_guard.on_backward(loss)
        return super().backward(loss, **kwargs)


def nonfinite(obj, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating-point tensors or arrays in ``obj`` (nested dicts,
    lists, tuples) holding a NaN or an infinity."""
    import numpy as np

    out: list[str] = []
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and not bool(torch.isfinite(obj).all()):
            out.append(prefix or "<tensor>")
    elif isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f" and obj.size and not np.isfinite(obj).all():
            out.append(prefix or "<array>")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += nonfinite(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += nonfinite(v, f"{prefix}[{i}]")
    return out
