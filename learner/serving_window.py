"""Serving windows: one GPU time-sliced between serving and training at matmul granularity.

When the learner serves and trains on the same GPU, a CUDA stream's priority orders only the
blocks waiting to be scheduled: training's kernels already queued or running keep their SMs
(Hopper's GEMMs are persistent: one kernel holds every SM until its last tile), and an act that
arrives in the middle of an update step waits behind them (docs/benchmarks.md, "Training while
serving on one device"). A serving window closes that gap from the training side:

- the inference thread holds the window open from a batch's first request to its replies,
  new weights loaded in it (:meth:`ServingWindow.serving`);
- the trained module calls :meth:`ServingWindow.checkpoint` before each of its matmuls and
  after each trainable parameter's gradient: forward pre-hooks on every ``nn.Linear`` outside
  LoRA adapters (models such as lerobot's PI0 index their transformer layers and call the
  layers' sub-modules directly, so a hook on a layer would never run) and a hook after each
  trainable parameter's gradient is accumulated (the backward, on autograd's thread)
  (:meth:`ServingWindow.attach`);
- at a checkpoint the trainer never runs more than ``lead`` checkpoints ahead of the GPU (it
  waits on the CUDA event recorded ``lead`` checkpoints back: a ring of ``lead`` events, reused)
  and while a window is open it launches nothing until the window closes (at most
  ``max_wait_s`` per checkpoint, so a serving thread that stalls cannot stop training).

An act then waits for at most ``lead`` matmuls' worth of training work, not a whole step;
training pays the windows' length plus the checkpoints' cost. A longer lead keeps the GPU fed
between the trainer's launches and lengthens that wait. Off a GPU the lead is not bounded (CPU
work is not queued) and only the window applies. ``inference.serving_window=true`` turns it on
in the learner (serving and training on the same device; ``inference.serving_window_lead``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import torch

#: the default lead, in checkpoints (matmuls or gradients) the trainer may run ahead of the GPU
LEAD = 8


class ServingWindow:
    def __init__(self, *, lead: int = LEAD, max_wait_s: float = 0.5):
        if lead < 1:
            raise ValueError(f"serving window: lead must be >= 1 checkpoint, got {lead}")
        if max_wait_s <= 0:
            raise ValueError(f"serving window: max_wait_s must be > 0, got {max_wait_s}")
        self.lead, self.max_wait_s = int(lead), float(max_wait_s)
        self._cv = threading.Condition()
        self._open = 0  # batches being served now
        #: a ring of ``lead`` CUDA events: slot k % lead holds checkpoint k's until k + lead
        self._ring: list | None = None
        #: whether checkpoints record CUDA events: decided at the first one (CUDA is up by then
        #: on a GPU learner), not looked up at every checkpoint
        self._cuda: bool | None = None
        #: how many checkpoints waited for a window, for how long in all, and how many gave up
        self.waits, self.waited_s, self.timeouts, self.checkpoints = 0, 0.0, 0, 0
        self.windows = 0
        #: seconds the inference thread held windows open, in all
        self.open_s = 0.0

    @property
    def is_open(self) -> bool:
        return self._open > 0

    def in_flight(self) -> int:
        """Checkpoints recorded on the GPU and not yet passed by it (0 off a GPU)."""
        return sum(1 for ev in self._ring or () if not ev.query())

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The inference thread, around one batch from its first request to its replies."""
        t0 = time.perf_counter()
        with self._cv:
            self._open += 1
            self.windows += 1
        try:
            yield
        finally:
            with self._cv:
                self._open -= 1
                self.open_s += time.perf_counter() - t0
                if not self._open:
                    self._cv.notify_all()

    def checkpoint(self) -> None:
        """The trainer (main thread or autograd's), between two matmuls' or gradients' work."""
        k = self.checkpoints
        self.checkpoints = k + 1
        if self._cuda is None:
            self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            if self._cuda:
                self._ring = [torch.cuda.Event() for _ in range(self.lead)]
        if self._cuda:
            ev = self._ring[k % self.lead]
            ev.synchronize()  # checkpoint k - lead's work is done (returns at once if never recorded)
            ev.record()       # on this thread's current stream: the trainer's
        if not self._open:  # read without the lock: a window opening now is seen at the next one
            return
        t0 = time.perf_counter()
        with self._cv:
            ok = self._cv.wait_for(lambda: not self._open, timeout=self.max_wait_s)
        self.waits += 1
        self.timeouts += not ok
        self.waited_s += time.perf_counter() - t0

    def attach(self, module: torch.nn.Module) -> list:
        """Hooks on ``module``: a checkpoint before every ``nn.Linear`` outside LoRA adapters runs
        (before every element of each ``nn.ModuleList`` where it has no such Linear) and after
        each trainable parameter's gradient is accumulated. Returns the handles (``h.remove()``
        detaches them)."""
        def pre(_m, _a):
            self.checkpoint()

        def post(_p):
            self.checkpoint()
        sites = [m for name, m in module.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".lora_" not in f".{name}"]
        if not sites:
            sites = [layer for m in module.modules() if isinstance(m, torch.nn.ModuleList) for layer in m]
        handles = [m.register_forward_pre_hook(pre) for m in sites]
        handles += [p.register_post_accumulate_grad_hook(post) for p in module.parameters() if p.requires_grad]
        if not handles:
            raise ValueError(f"serving window: {type(module).__name__} has no nn.Linear, no nn.ModuleList "
                             "layers and no trainable parameters to hook")
        return handles

    def stats(self) -> dict:
        return {"windows": self.windows, "open_s": self.open_s, "checkpoints": self.checkpoints,
                "waits": self.waits, "waited_s": self.waited_s, "timeouts": self.timeouts, "lead": self.lead}
