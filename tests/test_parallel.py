"""agents/parallel/__init__.py on one CPU process, and its engine branches against a stand-in engine
(the real DeepSpeed runs are tests/test_deepspeed_gpu.py's)."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from agents import parallel


class FakeEngine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.calls: list[str] = []

    def backward(self, loss):
        self.calls.append("backward")
        loss.backward()

    def step(self):
        self.calls.append("step")

    def get_global_grad_norm(self):
        return 3.0


class FakeAccelerator:
    num_processes = 1

    def prepare(self, *objs):
        return objs if len(objs) > 1 else objs[0]


def test_prepare_and_step_without_engines():
    acc = Accelerator(cpu=True)
    m = torch.nn.Linear(2, 1)
    model, opt, second = parallel.prepare(acc, m, lambda: [torch.optim.SGD(m.parameters(), lr=0.1)], slots=2)
    assert second is None and parallel.engines(acc, model) == []
    norm = parallel.backward_step(acc, model, model(torch.ones(3, 2)).sum(), m.parameters(), 1e-3)
    assert norm is not None and float(norm) > 1e-3  # the norm before clipping
    assert float(torch.cat([p.grad.flatten() for p in m.parameters()]).norm()) <= 1e-3 + 1e-6
    assert parallel.rank_scale(acc, torch.ones(4)) == 1.0
    assert parallel.mean_over_ranks(acc, 0.25, torch.device("cpu")) == 0.25
    parallel.average_grads(m.parameters())  # one process: nothing to average


def test_engine_branches_take_the_engine_optimizer_and_step_the_engine(monkeypatch):
    monkeypatch.setattr(parallel, "uses_deepspeed", lambda acc: True)
    eng, acc = FakeEngine(), FakeAccelerator()
    made = []
    model, opt, second = parallel.prepare(acc, eng, lambda: made.append("local") or [1, 2],
                                          engine_optimizer=lambda: "engine-opt", slots=2)
    assert (model, opt, second, made) == (eng, "engine-opt", None, [])
    assert parallel.engines(acc, model) == [eng]
    norm = parallel.backward_step(acc, model, (eng.w * 2).sum(), None, 1.0)
    assert eng.calls == ["backward", "step"] and float(norm) == 3.0
