"""The raw pyzmq baselines' server side: a REP that answers every request with fixed bytes,
and a PULL sink that counts messages and bytes (the client side is
:class:`tools.bench.transport_client.ClientWorker`'s REQ and PUSH sockets)."""

from __future__ import annotations

import threading

import zmq

from tools.bench.common import bind_loopback, perf


class RawRep(threading.Thread):
    def __init__(self, ctx: zmq.Context, reply: bytes):
        super().__init__(name="bench-raw-rep", daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = bind_loopback(self.sock)
        self.reply = reply
        self.stop_event = threading.Event()

    def run(self) -> None:
        sock, reply = self.sock, self.reply
        while not self.stop_event.is_set():
            if sock.poll(100):
                sock.recv_multipart(copy=False)
                sock.send(reply)
        sock.close(0)


class RawSink(threading.Thread):
    def __init__(self, ctx: zmq.Context):
        super().__init__(name="bench-raw-sink", daemon=True)
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = bind_loopback(self.sock)
        self.stop_event = threading.Event()
        self.done = threading.Event()
        self.expect = 0
        self.count = 0
        self.nbytes = 0
        self.t_last = 0.0

    def reset(self, expect: int) -> None:
        self.count, self.nbytes, self.expect = 0, 0, expect
        self.done.clear()

    def run(self) -> None:
        sock = self.sock
        while not self.stop_event.is_set():
            if not sock.poll(100):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.nbytes += sum(len(f) for f in frames)
                self.count += 1
                if self.count == self.expect:
                    self.t_last = perf()
                    self.done.set()
        sock.close(0)
