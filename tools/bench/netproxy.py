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
- ``rate_kbps``: a thin link, at most this many kilobytes per second each way. The proxy then
  holds at most ~0.1 s of traffic per direction and reads no more until it is sent, so the
  sender's TCP stalls as on a real slow link (its ZeroMQ queue, and a PUB's high-water mark,
  come into play) rather than the proxy buffering without bound.

It also reads the ZeroMQ (ZMTP 3, NULL mechanism) framing of what it forwards, without
changing a byte: :attr:`NetProxy.counters` ``messages`` counts whole messages delivered, and
a sender whose stream ends part way through a message (it was killed mid-send) counts in
``cut_messages``, with the bytes of that message it had sent in ``cut_bytes``: the receiving
ZeroMQ socket drops such a message, and a test can assert that the cut really happened.
:meth:`NetProxy.mid_message` tells whether a sender is part way through a message now.

    python -m tools.bench.netproxy --listen 6000 --to 5588 --delay-ms 50 --jitter-ms 20 --loss 0.05
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from collections import deque


class ZmtpTracker:
    """Follows one direction of a ZMTP 3 stream (greeting, then frames: a flags byte, a 1- or
    8-byte size, the body) to tell whole messages from a cut one. Not ZMTP (no signature, or
    an encrypting mechanism): it stops tracking and counts nothing."""

    GREETING = 64

    def __init__(self):
        self.active = True
        self._greeting = b""
        self._head = b""        # a frame header being read
        self._body_left = 0     # bytes of the current frame body still to come
        self._more = False      # the current message has more frames
        self._command = False
        self.msg_bytes = 0      # bytes of the message in progress delivered so far
        self.messages = 0

    def feed(self, data: bytes) -> None:
        mv, i, n = memoryview(data), 0, len(data)
        while self.active and i < n:
            if len(self._greeting) < self.GREETING:
                take = min(self.GREETING - len(self._greeting), n - i)
                self._greeting += bytes(mv[i:i + take])
                i += take
                g = self._greeting
                if (g[:1] and g[0] != 0xFF) or (len(g) >= 10 and g[9] != 0x7F) or (
                        len(g) >= 32 and g[12:32].rstrip(b"\0") not in (b"NULL", b"PLAIN")):
                    self.active = False
                continue
            if self._body_left:
                take = min(self._body_left, n - i)
                self._body_left -= take
                i += take
                if not self._command:
                    self.msg_bytes += take
                if not self._body_left:
                    self._frame_done()
                continue
            self._head += bytes(mv[i:i + 1])
            i += 1
            flags = self._head[0]
            need = 9 if flags & 0x02 else 2
            if len(self._head) < need:
                continue
            size = int.from_bytes(self._head[1:need], "big")
            self._command = bool(flags & 0x04)
            if not self._command:
                self._more = bool(flags & 0x01)
                self.msg_bytes += need
            self._head = b""
            self._body_left = size
            if not size:
                self._frame_done()

    def _frame_done(self) -> None:
        if not self._command and not self._more:
            self.messages += 1
            self.msg_bytes = 0

    @property
    def mid_message(self) -> bool:
        """Part of a message has been delivered, not all of it."""
        return self.active and (self.msg_bytes > 0 or (bool(self._head) and not self._head[0] & 0x04))


class NetProxy:
    def __init__(self, listen_port: int, target_port: int, *, host: str = "127.0.0.1",
                 delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0,
                 rto_ms: float = 200.0, rate_kbps: float = 0.0, seed: int = 0):
        self.target = (host, target_port)
        self.delay_ms, self.jitter_ms, self.loss, self.rto_ms = delay_ms, jitter_ms, loss, rto_ms
        self.rate_kbps = rate_kbps
        self._trackers: list[ZmtpTracker] = []
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._partitioned = False
        self._closed = False
        self._conns: list[socket.socket] = []
        self.counters = {"connections": 0, "bytes": 0, "lost_chunks": 0, "resets": 0,
                         "messages": 0, "cut_messages": 0, "cut_bytes": 0}
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
                 loss: float | None = None, rate_kbps: float | None = None) -> None:
        with self._cv:
            if rate_kbps is not None:
                self.rate_kbps = rate_kbps
                self._cv.notify_all()
            if delay_ms is not None:
                self.delay_ms = delay_ms
            if jitter_ms is not None:
                self.jitter_ms = jitter_ms
            if loss is not None:
                self.loss = loss

    def mid_message(self) -> bool:
        """Some sender is part way through a ZeroMQ message (the proxy has read its start)."""
        with self._cv:
            return any(t.mid_message for t in self._trackers)

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
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if self.rate_kbps:  # a thin link buffers little: no large kernel window either
                upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._window())
            upstream.settimeout(5)
            upstream.connect(self.target)
        except OSError:
            upstream.close()
            client.close()
            return
        if self.rate_kbps:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._window())
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
            q = _Pipe()
            with self._cv:
                self._trackers.append(q.sent)
            threading.Thread(target=self._read, args=(a, b, q), daemon=True).start()
            threading.Thread(target=self._write, args=(b, a, q), daemon=True).start()

    def _window(self) -> int:
        """Bytes one direction may hold (0: no bound): ~0.1 s of a rate-limited link."""
        return max(4096, int(self.rate_kbps * 100)) if self.rate_kbps else 0

    def _due(self, last_due: float) -> float:
        with self._cv:
            d = self.delay_ms + (self._rng.uniform(-1, 1) * self.jitter_ms if self.jitter_ms else 0.0)
            if self.loss and self._rng.random() < self.loss:
                d += self.rto_ms
                self.counters["lost_chunks"] += 1
        return max(last_due, time.monotonic() + max(0.0, d) / 1000.0)

    def _read(self, src: socket.socket, dst: socket.socket, q: "_Pipe") -> None:
        last_due = 0.0
        while True:
            with self._cv:  # a thin link: read no more than it can hold (the sender stalls)
                while (w := self._window()) and q.nbytes >= w and not self._closed:
                    self._cv.wait(0.5)
                size = min(65536, w - q.nbytes) if w else 65536
            ended = True  # the sender closed (or died): not the proxy closing its side
            try:
                data = src.recv(size)
            except ConnectionResetError:
                data = b""
            except OSError:
                data, ended = b"", False
            last_due = self._due(last_due)
            with self._cv:
                q.append((last_due, data))
                q.nbytes += len(data)
                q.sent.feed(data)
                if not data:
                    self._end(q, counted=ended)
                self._cv.notify_all()
            if not data:
                return

    def _write(self, dst: socket.socket, src: socket.socket, q: "_Pipe") -> None:
        next_tx = 0.0  # a rate-limited link sends its next byte no earlier than this
        while True:
            with self._cv:
                while not self._closed and (not q or self._partitioned
                                            or max(q[0][0], next_tx) > time.monotonic()):
                    due = max(q[0][0], next_tx) if q else 0.0
                    wait = (due - time.monotonic()) if q and not self._partitioned else 0.5
                    self._cv.wait(max(0.001, min(wait, 0.5)))
                if self._closed:
                    return
                _, data = q.popleft()
                if self.rate_kbps and len(data) > self.rate_kbps * 20:  # <= 20 ms at a time
                    cut = max(1, int(self.rate_kbps * 20))
                    q.appendleft((0.0, data[cut:]))
                    data = data[:cut]
                q.nbytes -= len(data)
                self.counters["bytes"] += len(data)
                if self.rate_kbps:
                    next_tx = max(next_tx, time.monotonic()) + len(data) / (self.rate_kbps * 1000)
                self._cv.notify_all()
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
                with self._cv:
                    q.zmtp.feed(data)
                    self.counters["messages"] += q.zmtp.messages - q.counted
                    q.counted = q.zmtp.messages
            except OSError:
                for s in (dst, src):
                    try:
                        s.close()
                    except OSError:
                        pass
                return

    def _end(self, q: "_Pipe", *, counted: bool = True) -> None:
        """A sender's stream ended (under the lock): a message it was part way through is cut
        (``counted``: the sender ended it, rather than the proxy closing the connection)."""
        if q.sent in self._trackers:
            self._trackers.remove(q.sent)
            if counted and q.sent.mid_message:
                self.counters["cut_messages"] += 1
                self.counters["cut_bytes"] += q.sent.msg_bytes


class _Pipe(deque):
    """One direction's queue of (due time, bytes), its size, and ZMTP trackers of what the
    sender sent and what the receiver got."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.sent = ZmtpTracker()
        self.zmtp = ZmtpTracker()
        self.counted = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--to", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--rate-kbps", type=float, default=0.0, help="bandwidth each way (0: unlimited)")
    a = ap.parse_args()
    p = NetProxy(a.listen, a.to, delay_ms=a.delay_ms, jitter_ms=a.jitter_ms, loss=a.loss,
                 rate_kbps=a.rate_kbps)
    print(f"proxy 127.0.0.1:{p.port} -> {a.to}; Ctrl-C stops")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        p.close()


if __name__ == "__main__":
    main()
