"""learner/serving_window.py: training waits at its next matmul while a batch is served
(``inference.serving_window``), with real threads, a real module's hooks and a real learner."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from learner.serving_window import ServingWindow


def hold_open(window: ServingWindow, seconds: float) -> threading.Thread:
    opened = threading.Event()

    def serve():
        with window.serving():
            opened.set()
            time.sleep(seconds)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert opened.wait(5)
    return t


def test_a_checkpoint_passes_when_closed_and_waits_while_a_batch_is_served():
    w = ServingWindow(max_wait_s=5.0)
    t0 = time.perf_counter()
    w.checkpoint()
    assert time.perf_counter() - t0 < 0.05 and w.waits == 0
    t = hold_open(w, 0.3)
    t0 = time.perf_counter()
    w.checkpoint()
    waited = time.perf_counter() - t0
    t.join()
    assert 0.2 < waited < 2.0, waited
    assert w.stats()["waits"] == 1 and w.timeouts == 0 and w.windows == 1 and not w.is_open


def test_a_stalled_server_holds_training_for_at_most_max_wait_s():
    w = ServingWindow(max_wait_s=0.1)
    t = hold_open(w, 1.0)
    t0 = time.perf_counter()
    w.checkpoint()
    w.checkpoint()
    assert time.perf_counter() - t0 < 0.6
    assert w.timeouts == 2 and w.waits == 2
    t.join()


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="lead"):
        ServingWindow(lead=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        ServingWindow(max_wait_s=0)
    with pytest.raises(ValueError, match="Identity.*no nn.Linear"):
        ServingWindow().attach(torch.nn.Identity())


class Layers(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_hooks_checkpoint_every_matmul_forward_and_every_gradient_and_detach():
    torch.manual_seed(0)
    m, w = Layers(4), ServingWindow()
    handles = w.attach(m)
    m(torch.randn(2, 8)).sum().backward()
    assert w.checkpoints == 4 + 8          # 4 Linears' forward, 8 parameters' gradients
    for h in handles:
        h.remove()
    m(torch.randn(2, 8)).sum().backward()
    assert w.checkpoints == 12


class Indexed(torch.nn.Module):
    """Layers indexed and their sub-modules called directly (as lerobot's PI0 does), LoRA on
    each, only the adapters trained."""

    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8)})
                                          for _ in range(n))

    def forward(self, x):
        for i in range(len(self.layers)):
            layer = self.layers[i]
            x = layer["b"](torch.tanh(layer["a"](x)))
        return x


def test_layers_called_by_index_still_checkpoint_at_each_matmul_and_adapters_are_not_sites():
    from agents.policies.vla_common import add_lora

    torch.manual_seed(0)
    m = Indexed(3)
    add_lora(m, rank=2, alpha=4, dropout=0.0, target_regex=r"layers\.\d+\.(a|b)")
    for name, p in m.named_parameters():
        p.requires_grad_(".lora_" in name)
    w = ServingWindow()
    w.attach(m)
    m(torch.randn(2, 8)).sum().backward()
    # 6 base Linears' forward (the adapters' own Linears are not sites), 12 adapter gradients
    assert w.checkpoints == 6 + 12


def test_a_training_step_does_not_finish_while_a_window_is_open():
    torch.manual_seed(0)
    m, w = Layers(4), ServingWindow(max_wait_s=10.0)
    w.attach(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    release = threading.Event()
    opened = threading.Event()

    def serve():
        with w.serving():
            opened.set()
            release.wait(10)
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    assert opened.wait(5)
    done = threading.Event()

    def train():
        opt.zero_grad()
        m(torch.randn(2, 8)).pow(2).sum().backward()
        opt.step()
        done.set()
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    time.sleep(0.3)
    assert not done.is_set() and w.checkpoints == 1   # stopped before the first layer
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    release.set()
    assert done.wait(10)
    assert w.waits == 1 and w.timeouts == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.slow
def test_a_learner_with_serving_window_trains_and_reports_its_windows(tmp_path):
    """``inference.serving_window=true`` in a real learner serving a real actor on loopback:
    it trains, every served batch opens a window, and status.json says how long training waited."""
    from test_integration import Run

    run = Run(tmp_path)
    try:
        run.learner("inference.serving_window=true", "trainer.checkpoint_every=0")
        run.actor("a0")
        run.wait(lambda: run.status().get("updates", 0) >= 20 and run.status().get("version", 0) >= 2,
                 120, "20 updates")
        st = run.status()
        sw = st["serving_window"]
        assert sw["windows"] >= st["infer_batches"] - 1 > 0
        assert sw["checkpoints"] > st["updates"]      # several per update: every trainable gradient
        assert st["window_waited_s"] == pytest.approx(sw["waited_s"]) and sw["timeouts"] == 0
        # a policy without a warm-up: nothing staged, batches not capped
        assert st["serving_warmup"] == {"mode": "all", "buckets_s": {}, "to_warm": [],
                                        "cap": 64, "total_s": None}  # inference.max_batch's default
    finally:
        run.stop_all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_trainer_runs_at_most_lead_checkpoints_ahead():
    """CUDA work is queued: a checkpoint keeps at most ``lead`` recorded points in flight, so a
    window that opens waits for at most that many layers of already-launched training work."""
    m, w = Layers(4).cuda(), ServingWindow(lead=2)
    w.attach(m)
    x = torch.randn(1 << 16, 8, device="cuda")
    seen = []
    for p in m.parameters():  # after each gradient's own checkpoint: how many are still queued
        p.register_post_accumulate_grad_hook(lambda _p: seen.append(w.in_flight()))
    for _ in range(3):
        m(x).pow(2).sum().backward()
    torch.cuda.synchronize()
    assert w.checkpoints == 3 * 12 and len(seen) == 3 * 8
    assert max(seen) <= 2 and w.in_flight() == 0
