"""The wire gate's process (``python -m data.core.gate_main``, started by
:class:`data.core.gate.Gate`): it owns a server's network-facing ZMQ sockets and relays to the
server over private ipc sockets. Only ``zmq`` and :mod:`data.core.security` are imported here.

Per front (its JSON config comes on stdin, see :class:`data.core.gate.Front`):

- ``router`` (the learner's main and act sockets, the robot driver's): a ROUTER bound to
  ``host:port`` (CURVE and its ZAP handler when keys are configured), ``ZMQ_MAXMSGSIZE`` =
  the per-frame limit (a larger frame disconnects its peer before it is buffered). A whole
  message of at most ``max_frames`` frames and ``max_message_bytes`` bytes goes to the
  server's DEALER as ``[routing id, (CURVE User-Id,) frames...]``; a larger one is dropped,
  counted and answered with the server's ``too_large_reply`` frames. When the server's end is
  full (a server thread behind), that one message waits here and its front is not read until
  the server takes it (``server_full`` counts the pauses; the peers wait in their own queues):
  the other fronts and the replies never wait behind it (one server thread's backlog, the
  learner's ingest, must not hold up another's, its act socket). Replies come back as
  ``[routing id, frames...]`` and go out on the ROUTER (dropped when the peer is gone).
- ``pub`` (weight broadcasts): a PUB bound to ``host:port`` fed by a SUB connected to the
  server's PUB; subscribers' inbound frames are limited to ``max_frame_bytes`` too.

libzmq has no bound on the frames of one message and buffers a message whole before anyone
sees it: here that memory is the gate's, capped by ``RLIMIT_DATA`` (``memory_bytes`` above
what the imports use). A peer that goes past it, or one that makes libzmq abort (a routing id
of the form libzmq generates, colliding with a later peer's generated one: an assertion in
``socket_base.cpp``), ends this process, never the server's: the server starts a new gate.

The gate ignores SIGINT (a Ctrl-C reaching the process group must not cut the server's last
replies; the server stops it), exits on SIGTERM and when its parent process is gone (then it
removes the server's private folder, which a killed server cannot). Every
2 s it writes its counters as one JSON line on stdout (when they changed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import zmq

_SNDMORE, _RCVMORE, _NOBLOCK = 2, 13, 1
_POLLIN, _POLLOUT = 1, 2


def _recv(sock: zmq.Socket) -> list:
    frame = sock.recv(_NOBLOCK, copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        parts.append(frame)
    return parts


def _send(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, flags | _SNDMORE if i < last else flags, copy=False)


def _remove_folder(cfg: dict) -> None:
    """The server's private ipc folder (``.../tandem-gate-*``), which a killed server leaves."""
    import shutil

    folders = {os.path.dirname(f["backend"][len("ipc://"):]) for f in cfg["fronts"]
               if f["backend"].startswith("ipc://")}
    for folder in folders:
        if os.path.basename(folder).startswith("tandem-gate-"):
            shutil.rmtree(folder, ignore_errors=True)


def _seed_routing_ids() -> None:
    """libzmq starts each ROUTER's generated routing ids at ``rand()`` and never seeds it
    (every process's first ROUTER: 0x6b8b4567): seed it from the OS, so that ids a peer held
    against the last gate (its sockets reconnect by themselves) mean nothing to this one."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))
    except (OSError, AttributeError):
        pass


def _limit_memory(extra: int) -> None:
    """RLIMIT_DATA = what this process uses now + ``extra`` bytes (Linux counts private
    writable mappings in it: malloc's heap and mmaps, libzmq's message buffers included)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + extra, used + extra))
    except (ImportError, OSError, StopIteration, ValueError):  # not Linux: no cap
        pass


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    from data.core.security import configure_server_socket

    _seed_routing_ids()
    ctx = zmq.Context()
    fronts, backs, routes = [], [], {}
    counters = {"forwarded": 0, "replies": 0, "broadcasts": 0, "too_large": 0, "too_many_frames": 0,
                "dropped_to_server": 0, "server_full": 0}
    curve = bool(cfg["security"].get("server_secret_key"))
    ports = {}
    try:
        for f in cfg["fronts"]:
            kind = f["kind"]
            front = ctx.socket(zmq.ROUTER if kind == "router" else zmq.PUB)
            front.setsockopt(zmq.LINGER, 0)
            configure_server_socket(front, f["host"], cfg["security"])
            front.setsockopt(zmq.MAXMSGSIZE, int(f["max_frame_bytes"]))
            if kind == "router":
                front.setsockopt(zmq.ROUTER_MANDATORY, 0)
                front.setsockopt(zmq.RCVHWM, int(f.get("rcvhwm", 16)))
                back = ctx.socket(zmq.DEALER)
                back.setsockopt(zmq.SNDHWM, int(f.get("sndhwm", 32)))
            else:
                front.setsockopt(zmq.SNDHWM, 2)
                back = ctx.socket(zmq.SUB)
                back.setsockopt(zmq.RCVHWM, 2)
                back.setsockopt(zmq.SUBSCRIBE, b"")
            back.setsockopt(zmq.LINGER, 0)
            back.connect(f["backend"])
            try:
                front.bind(f"tcp://{f['host']}:{f['port']}")
            except zmq.ZMQError as exc:
                if not (f.get("fallback") and f["port"]):
                    raise zmq.ZMQError(exc.errno, f"{f['name']} socket: cannot bind {f['host']}:{f['port']} "
                                       f"({exc})") from exc
                front.bind(f"tcp://{f['host']}:0")
            ports[f["name"]] = int(front.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
            fronts.append(front)
            backs.append(back)
            routes[front] = (back, f)
            routes[back] = (front, f)
    except (zmq.ZMQError, ValueError, OSError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        ctx.destroy(0)
        sys.exit(3)
    _limit_memory(int(cfg["memory_bytes"]))
    print(json.dumps({"ports": ports}), flush=True)
    try:
        os.set_blocking(sys.stdout.fileno(), False)  # a stats line never blocks the relay
    except OSError:
        pass
    readable = [s for s in fronts + backs if s.type != zmq.PUB]  # (a PUB has nothing to read)
    # a router front whose server end is full: its message waits here and the front is not
    # read (its peers wait in their own queues), while every other front and the replies go on
    pending: dict[zmq.Socket, list] = {}
    last_stats, shown = time.monotonic(), dict(counters)
    while True:
        items = [(s, _POLLIN | (_POLLOUT if routes[s][0] in pending else 0)) for s in readable
                 if s not in pending]
        for sock, ev in zmq.zmq_poll(items, 500):
            other, f = routes[sock]
            if ev & _POLLOUT and other in pending:  # the server takes the waiting message now
                msg = pending.pop(other)
                if not _to_server(sock, msg, counters):
                    pending[other] = msg
            if not ev & _POLLIN:
                continue
            for _ in range(64):  # a few per wake-up, so no socket starves
                try:
                    frames = _recv(sock)
                except zmq.Again:
                    break
                if sock in fronts and f["kind"] == "router":
                    left = _inbound(frames, sock, other, f, curve, counters)
                    if left is not None:
                        pending[sock] = left
                        counters["server_full"] += 1
                        break
                elif f["kind"] == "router":  # the server's reply: [routing id, frames...]
                    try:
                        _send(other, frames, _NOBLOCK)
                        counters["replies"] += 1
                    except zmq.ZMQError:  # the peer is gone or full: dropped, as a ROUTER does
                        pass
                elif sock in backs:  # a broadcast from the server's PUB
                    _send(other, frames)
                    counters["broadcasts"] += 1
        now = time.monotonic()
        if os.getppid() != parent:  # the server is gone (killed): so is its gate, and its folder
            _remove_folder(cfg)
            break
        if now - last_stats >= 2.0:
            last_stats = now
            if counters != shown:
                shown = dict(counters)
                try:
                    sys.stdout.write(json.dumps({"stats": shown}) + "\n")
                    sys.stdout.flush()
                except (BlockingIOError, OSError):
                    pass
    ctx.destroy(0)


def _inbound(frames: list, front: zmq.Socket, back: zmq.Socket, f: dict, curve: bool,
             counters: dict) -> list | None:
    """A peer's message ([routing id, frames...]): within the limits, to the server. Returns
    the message to send when the server's end is full (else None: sent, or refused)."""
    n = len(frames) - 1
    size = sum(map(len, frames)) - len(frames[0])
    why = ("too_many_frames" if n > f["max_frames"] else
           "too_large" if size > f["max_message_bytes"] else None)
    if why is not None:
        counters[why] += 1
        reply = f.get("too_large_reply")
        if reply:
            try:
                _send(front, [frames[0], *[bytes.fromhex(x) for x in reply]], _NOBLOCK)
            except zmq.ZMQError:
                pass
        return None
    head = [frames[0]]
    if curve:
        try:
            user = frames[1].get("User-Id") if n else None
        except zmq.ZMQError:
            user = None
        head.append((user or "").encode())
    msg = head + frames[1:]
    return None if _to_server(back, msg, counters) else msg


def _to_server(back: zmq.Socket, msg: list, counters: dict) -> bool:
    """Hand ``msg`` to the server's end without waiting; False when it is full (nothing sent:
    libzmq takes the rest of a message once it took its first frame)."""
    try:
        _send(back, msg, _NOBLOCK)
    except zmq.Again:
        return False
    counters["forwarded"] += 1
    return True


if __name__ == "__main__":
    main()
