"""Attacks by class on a learner's wire, as a hostile client sends them (issue 24): each
generator sends one class of crafted traffic to ``host:port`` over loopback and returns how
many messages (or connections) it sent. :mod:`tools.bench.fuzz_live` runs them for minutes against a
live learner with a real actor attached; the tests run each once.

- :func:`routing_ids`: connections holding ZMQ routing ids of the form libzmq generates
  (``\\0`` + a 32-bit counter; the counter's first values in an unseeded process, and random
  ones), then connections without one, whose generated id may collide (libzmq asserts);
- :func:`float_extremes`: transition batches with float32-limit (and just-out-of-range)
  values in every float field (reward, action, state, each float extra);
- :func:`id_edges`: sequence numbers, episode ids, steps and versions at the edges of their
  ranges (top, one below, one above), in headers and arrays;
- :func:`huge_frames`: a frame over the limit, many frames under it adding up past it, and a
  message of more frames than the limit;
- :func:`bad_shapes`: array metadata with 4.0 / True / -1 dims and extra items, sent after
  the same layout was cached by a valid message.
"""

from __future__ import annotations

import itertools
import random

import msgpack
import numpy as np
import zmq

from data.core.codec import encode
from data.core.schema import MAX_SEQ, OBS_STATE, STEP_ARRAYS, STEP_BOUNDS
from data.core.spec import EnvSpec

F32_MAX = float(np.finfo(np.float32).max)
#: where the generated routing ids of a process's first ROUTERs start when libzmq's rand() is
#: unseeded (glibc: srand(1)): the first, the second and the third ROUTER
UNSEEDED_STARTS = (0x6B8B4567, 0xE43C9869, 0xF4B0DC51)
_ids = itertools.count()


def _dealer(ctx: zmq.Context, port: int, host: str = "127.0.0.1", routing_id: bytes | None = None,
            security: dict | None = None) -> zmq.Socket:
    from data.core.security import configure_client_socket

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 2000)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    configure_client_socket(s, security or {})
    s.connect(f"tcp://{host}:{port}")
    return s


def _drain(s: zmq.Socket, timeout_ms: int = 300) -> int:
    n = 0
    while s.poll(timeout_ms):
        s.recv_multipart()
        n += 1
        timeout_ms = 50
    return n


def routing_ids(ctx: zmq.Context, ports: list[int], *, span: int = 64, randoms: int = 64,
                triggers: int = 4, host: str = "127.0.0.1", hold_s: float = 0.3) -> int:
    """Hold ids ``\\0`` + (start + k) for every unseeded start and k < ``span``, and
    ``randoms`` random ones, on each port (each connection sends a byte, so its id is taken),
    then open ``triggers`` connections without an id per port. Returns the connections made."""
    import time

    held: list[zmq.Socket] = []
    rng = random.Random()
    ids = [(start + k) & 0xFFFFFFFF for start in UNSEEDED_STARTS for k in range(span)]
    ids += [rng.getrandbits(32) for _ in range(randoms)]
    try:
        for port in ports:
            for x in ids:
                s = _dealer(ctx, port, host, b"\x00" + x.to_bytes(4, "big"))
                s.send(b"\x00")
                held.append(s)
        time.sleep(hold_s)
        for port in ports:
            for _ in range(triggers):
                s = _dealer(ctx, port, host)
                s.send(b"\x00")
                held.append(s)
        time.sleep(hold_s)
        return len(held)
    finally:
        for s in held:
            s.close(0)


def _hello(s: zmq.Socket, actor_id: str, config_hash: str, resend_from: int = 0) -> None:
    s.send_multipart(encode("hello", {"actor_id": actor_id, "config_hash": config_hash,
                                      "resend_from": resend_from}))
    _drain(s)


def _records(spec: EnvSpec, n: int, episode: int = 0, step0: int = 0) -> dict[str, np.ndarray]:
    a = {OBS_STATE: np.zeros((n, spec.state_dim), np.float32),
         "action": np.zeros((n, spec.action_dim), np.float32)}
    for cam, shape in spec.cameras.items():
        a["observation.images." + cam] = np.zeros((n, *shape), np.uint8)
    for k, dt in STEP_ARRAYS.items():
        a.setdefault(k, np.zeros(n, dt))
    a["episode"] = np.full(n, episode, np.int64)
    a["step"] = np.arange(step0, step0 + n, dtype=np.int64)
    a["group_id"] = np.full(n, -1, np.int64)
    for name, (dt, shape) in spec.extras.items():
        a["extra." + name] = np.zeros((n, *shape), dt)
    return a


def _batch(actor: str, first: int, arrays: dict, n: int) -> list:
    return encode("transitions", {"actor_id": actor, "first_seq": first, "last_seq": first + n - 1,
                                  "tasks": [""] * n}, arrays)


def float_extremes(ctx: zmq.Context, port: int, spec: EnvSpec, config_hash: str, *,
                   host: str = "127.0.0.1") -> int:
    """One session; for every float field, batches with +-float32 max, a value just past its
    declared range, and the smallest subnormal. Returns the batches sent."""
    s = _dealer(ctx, port, host)
    actor = f"fx-{next(_ids)}"
    try:
        _hello(s, actor, config_hash)
        seq, sent, n = 0, 0, 2
        for field, (lo, hi) in spec.float_ranges.items():
            for value in (F32_MAX, -F32_MAX, hi * 1.5 + 1, lo * 1.5 - 1, 1e-45):
                arrays = _records(spec, n, episode=sent)
                arrays[field] = np.full_like(arrays[field], np.float32(value))
                s.send_multipart(_batch(actor, seq, arrays, n))
                seq += n
                sent += 1
        _drain(s)
        return sent
    finally:
        s.close(0)


def id_edges(ctx: zmq.Context, port: int, spec: EnvSpec, config_hash: str, *,
             host: str = "127.0.0.1") -> int:
    """Sessions that resend from, number batches at, and fill arrays with values at the edges of
    the ranges (top, one below, one above, 0, -1), then handshake again. Returns messages sent."""
    sent = 0
    for top in (MAX_SEQ - 1, MAX_SEQ, MAX_SEQ + 1, 2**63 - 1):
        actor = f"edge-{next(_ids)}"
        s = _dealer(ctx, port, host)
        try:
            resend = min(max(top - 4, 0), MAX_SEQ)
            _hello(s, actor, config_hash, resend)
            for name, (lo, hi) in STEP_BOUNDS.items():
                for v in (hi - 1, hi, hi + 1, lo, lo - 1):
                    arrays = _records(spec, 2)
                    arrays[name] = np.full(2, max(min(v, 2**63 - 1), -(2**63)), np.int64)
                    first = min(resend, 2**63 - 3)
                    s.send_multipart(_batch(actor, first, arrays, 2))
                    sent += 1
            raw = {"v": 1, "type": "transitions", "actor_id": actor, "first_seq": min(top, 2**64 - 2),
                   "last_seq": min(top + 1, 2**64 - 1), "tasks": ["", ""], "arrays": []}
            s.send_multipart([msgpack.packb(raw, use_bin_type=True)])
            s.send_multipart(encode("get_job", {"episode": min(top, 2**62)}))
            sent += 2
            _drain(s)
        finally:
            s.close(0)
        s = _dealer(ctx, port, host)  # the same actor handshakes again: its welcome must encode
        try:
            _hello(s, actor, config_hash, min(top, MAX_SEQ))
            sent += 1
        finally:
            s.close(0)
    return sent


def huge_frames(ctx: zmq.Context, port: int, *, limit: int, host: str = "127.0.0.1") -> int:
    """A frame of ``limit`` + 1 bytes; frames of min(8 MiB, ``limit``) each, past ``limit`` in
    all; a message of 5000 one-byte frames. The same buffer is sent each time (no copies
    here). Returns the messages sent."""
    big = bytes(limit + 1)
    size = min(8 << 20, limit)
    piece = memoryview(bytes(size))
    s = _dealer(ctx, port, host)
    try:
        s.send(big, copy=False)
        s.close(0)
        s = _dealer(ctx, port, host)
        s.send_multipart([piece] * (limit // size + 2), copy=False)
        s.send_multipart([b"x"] * 5000)
        _drain(s, 1000)
        return 3
    finally:
        s.close(0)


def bad_shapes(ctx: zmq.Context, port: int, spec: EnvSpec, config_hash: str, *,
               host: str = "127.0.0.1") -> int:
    """A valid act (its layout is now cached), then the same layout with each inexact entry.
    Returns the messages sent."""
    s = _dealer(ctx, port, host)
    actor = f"shape-{next(_ids)}"
    try:
        _hello(s, actor, config_hash)
        obs = {OBS_STATE: np.zeros((1, spec.state_dim), np.float32)}
        for cam, shape in spec.cameras.items():
            obs["observation.images." + cam] = np.zeros((1, *shape), np.uint8)
        good = encode("act", {"req_id": 1, "deterministic": True, "tasks": [""]}, obs)
        s.send_multipart(good)
        header = msgpack.unpackb(good[0])
        sent = 1
        d = spec.state_dim
        for bad in ([1.0, d], [True, d], [1, float(d)], [1, d, 1.5], [-1, d], [1, 2**40]):
            meta = [list(e) for e in header["arrays"]]
            meta[0][2] = bad
            s.send_multipart([msgpack.packb(dict(header, arrays=meta), use_bin_type=True),
                              *[bytes(memoryview(f)) for f in good[1:]]])
            sent += 1
        meta = [list(e) + ["extra"] for e in header["arrays"]]
        s.send_multipart([msgpack.packb(dict(header, arrays=meta), use_bin_type=True),
                          *[bytes(memoryview(f)) for f in good[1:]]])
        _drain(s)
        return sent + 1
    finally:
        s.close(0)
