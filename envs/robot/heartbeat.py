"""The client's heartbeat thread: keeps the driver from stopping an idle robot, and
notices when the driver stops answering."""

from __future__ import annotations

import itertools
import threading
import time

import zmq

from data.core.codec import CodecError, decode, encode
from data.core.security import configure_client_socket
from envs.robot.protocol import DRIVER_SCHEMAS


class Heartbeat(threading.Thread):
    """Sends heartbeats on its own DEALER socket; sets ``lost`` when acks stop coming."""

    def __init__(self, ctx: zmq.Context, address: str, client_id: str, period: float, timeout: float,
                 security: dict):
        super().__init__(daemon=True, name=f"robot-heartbeat-{client_id[:8]}")
        self.ctx, self.address, self.client_id = ctx, address, client_id
        self.period, self.timeout, self.security = float(period), float(timeout), security
        self.lost = threading.Event()
        self.halt = threading.Event()
        self.driver_stopped = False
        self.last_ack = time.monotonic()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # heartbeat acks are a few bytes
        configure_client_socket(sock, self.security)
        sock.connect(self.address)
        req = itertools.count(1)
        try:
            while not self.halt.is_set():
                sock.send_multipart(encode("heartbeat", {"client_id": self.client_id, "req": next(req),
                                                         "t": time.time()}, schemas=DRIVER_SCHEMAS),
                                    copy=False)
                deadline = time.monotonic() + self.period
                while (left := deadline - time.monotonic()) > 0 and not self.halt.is_set():
                    if sock.poll(int(left * 1000) + 1):
                        try:
                            msg = decode(sock.recv_multipart(copy=False), schemas=DRIVER_SCHEMAS)
                        except CodecError:
                            continue
                        if msg.type == "heartbeat_ack":
                            self.last_ack = time.monotonic()
                            self.driver_stopped = bool(msg["stopped"])
                if time.monotonic() - self.last_ack > self.timeout:
                    self.lost.set()
        finally:
            sock.close(0)
