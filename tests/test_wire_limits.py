"""Limits before buffering (issue 24, class 3): libzmq limits one frame (ZMQ_MAXMSGSIZE) but
not the frames of a message, and buffers a message whole before anyone sees it. The learner's
network-facing sockets are the wire gate's (data/core/gate.py): a frame over the limit
disconnects its peer unbuffered, a message over the limit in bytes or frames is refused before
it reaches the learner (``message_too_large``), and what the gate buffers is its own memory,
capped; the learner's memory does not move. A real LearnerService on loopback."""

import threading
import time

from data.core.codec import decode
from test_wire_hardening import dealer, make_service, served


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class PeakRSS:
    """This process's largest RSS while the block runs (sampled every 5 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def test_oversized_messages_never_reach_the_learners_memory(ports):
    svc, ingest, ctx, close = make_service(ports)  # max_message_bytes: 1 MiB
    try:
        s = dealer(ctx, svc.port)
        piece = memoryview(bytes(1 << 20))  # one frame at the limit, sent many times, no copies
        with PeakRSS() as mem:
            s.send_multipart([piece] * 768, copy=False)  # 768 MiB in one message
            assert s.poll(60000), "no answer to the oversized message"
            r = decode(s.recv_multipart())
        assert mem.growth < 128 << 20, f"the learner's RSS grew by {mem.growth >> 20} MiB"
        assert r.type == "error" and r["code"] == "message_too_large"
        s.send_multipart([b"x"] * 5000)  # more frames than any message has
        assert s.poll(10000)
        assert decode(s.recv_multipart())["code"] == "message_too_large"
        s.send(bytes(2 << 20))  # one frame over the limit: disconnected, nothing buffered
        assert not s.poll(1000)
        served(svc, ctx)  # the learner serves on
        assert svc.is_alive() and svc.counters["internal_errors"] == 0
    finally:
        close()


def _gate_rss(svc) -> int:
    with open(f"/proc/{svc.gate.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_gates_memory_is_capped(ports):
    """A message the gate cannot even hold (past its memory cap): libzmq's allocation fails,
    the sender is disconnected, the gate's memory stays under its cap and the learner's does
    not move; the learner serves on."""
    cap = 96 << 20
    svc, ingest, ctx, close = make_service(ports, gate_memory_bytes=cap)
    try:
        base, gate_peak = _gate_rss(svc), 0
        s = dealer(ctx, svc.port)
        piece = memoryview(bytes(1 << 20))
        with PeakRSS() as mem:
            s.send_multipart([piece] * 512, copy=False)  # 512 MiB: past the gate's cap
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                if svc.gate.alive():
                    gate_peak = max(gate_peak, _gate_rss(svc))
                time.sleep(0.01)
        assert gate_peak - base < cap, f"the gate held {(gate_peak - base) >> 20} MiB"
        assert mem.growth < 128 << 20, f"the learner's RSS grew by {mem.growth >> 20} MiB"
        s.close(0)
        svc.gate.poll()  # (were it to abort instead, a new gate would be serving now)
        served(svc, ctx, actor_id="after")
        assert svc.is_alive()
    finally:
        close()
