"""A loopback TCP proxy that breaks the link on purpose: partitions, delay, jitter, "loss".

Used by the fault-injection tests (tests/test_faults.py) and the soak tool where ``tc netem``
is not available (no ``sch_netem`` kernel module, or no root). Point the actor at the proxy's
port; the proxy forwards to the learner's.

- :meth:`NetProxy.partition` holds every byte in both directions (and new connections are
  accepted but not forwarded) until :meth:`NetProxy.heal`, like a black-holed link whose
  TCP retransmits get through once it heals. ``reset=True`` also cuts every open connection
  (a NAT or firewall that forgot the flow).
- ``delay_ms`` / ``jitter_ms`` delay every chunk (order is kept, as on one TCP stream).
- ``loss``: on a TCP link a lost segment is a retransmit ~``rto_ms`` later, never a hole in
  the stream; so a "lost" chunk (and what follows it) is delivered ``rto_ms`` late.

    python -m tools.netproxy --listen 6000 --to 5588 --delay-ms 50 --jitter-ms 20 --loss 0.05
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from collections import deque


class NetProxy:
    def __init__(self, listen_port: int, target_port: int, *, host: str = "127.0.0.1",
                 delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0,
                 rto_ms: float = 200.0, seed: int = 0):
        self.target = (host, target_port)
        self.delay_ms, self.jitter_ms, self.loss, self.rto_ms = delay_ms, jitter_ms, loss, rto_ms
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._partitioned = False
        self._closed = False
        self._conns: list[socket.socket] = []
        self.counters = {"connections": 0, "bytes": 0, "lost_chunks": 0, "resets": 0}
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((host, listen_port))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    # ---- control -----------------------------------------------------------------------------

    def partition(self, *, reset: bool = False) -> None:
        with self._cv:
            self._partitioned = True
            if reset:
                self._reset_all()

    def heal(self) -> None:
        with self._cv:
            self._partitioned = False
            self._cv.notify_all()

    def set_link(self, *, delay_ms: float | None = None, jitter_ms: float | None = None,
                 loss: float | None = None) -> None:
        with self._cv:
            if delay_ms is not None:
                self.delay_ms = delay_ms
            if jitter_ms is not None:
                self.jitter_ms = jitter_ms
            if loss is not None:
                self.loss = loss

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._reset_all()
            self._cv.notify_all()
        self._srv.close()

    def _reset_all(self) -> None:
        for s in self._conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.counters["resets"] += len(self._conns) // 2
        self._conns = []

    # ---- forwarding ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        with self._cv:  # a partitioned link connects nowhere until it heals
            while self._partitioned and not self._closed:
                self._cv.wait(0.5)
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
        with self._cv:
            if self._closed:
                client.close()
                upstream.close()
                return
            self._conns += [client, upstream]
            self.counters["connections"] += 1
        for a, b in ((client, upstream), (upstream, client)):
            q: deque = deque()
            threading.Thread(target=self._read, args=(a, b, q), daemon=True).start()
            threading.Thread(target=self._write, args=(b, a, q), daemon=True).start()

    def _due(self, last_due: float) -> float:
        with self._cv:
            d = self.delay_ms + (self._rng.uniform(-1, 1) * self.jitter_ms if self.jitter_ms else 0.0)
            if self.loss and self._rng.random() < self.loss:
                d += self.rto_ms
                self.counters["lost_chunks"] += 1
        return max(last_due, time.monotonic() + max(0.0, d) / 1000.0)

    def _read(self, src: socket.socket, dst: socket.socket, q: deque) -> None:
        last_due = 0.0
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            last_due = self._due(last_due)
            with self._cv:
                q.append((last_due, data))
                self._cv.notify_all()
            if not data:
                return

    def _write(self, dst: socket.socket, src: socket.socket, q: deque) -> None:
        while True:
            with self._cv:
                while not self._closed and (not q or self._partitioned
                                            or q[0][0] > time.monotonic()):
                    wait = (q[0][0] - time.monotonic()) if q and not self._partitioned else 0.5
                    self._cv.wait(max(0.001, min(wait, 0.5)))
                if self._closed:
                    return
                _, data = q.popleft()
                self.counters["bytes"] += len(data)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                for s in (dst, src):
                    try:
                        s.close()
                    except OSError:
                        pass
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--to", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    a = ap.parse_args()
    p = NetProxy(a.listen, a.to, delay_ms=a.delay_ms, jitter_ms=a.jitter_ms, loss=a.loss)
    print(f"proxy 127.0.0.1:{p.port} -> {a.to}; Ctrl-C stops")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        p.close()


if __name__ == "__main__":
    main()
