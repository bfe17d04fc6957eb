"""Property-based fuzzing of the learner's wire: hypothesis makes headers and frames for
every message type, valid and invalid, and sends them to a real LearnerService on loopback.

The property, per message: the learner answers it (every reply decodes) or drops it, keeps
serving, and no message raises past the checks (``counters["internal_errors"]`` stays 0,
i.e. every failure was named by an explicit check, not caught as a surprise). After the run
a real client still completes hello, act and an acknowledged transitions batch.

    python -m tools.bench.fuzz_wire --examples 20000      # a long run (the suite runs a few hundred)
    python -m tools.bench.fuzz_live --minutes 10 --out DIR   # + the attack classes, against a
                                                 # learner process with a real actor attached

The attack classes of issue 24 (routing ids, finite extremes in every float field, ids at range
edges, huge frames and frame counts, malformed shapes) are in :mod:`tools.bench.fuzz_attacks`; the
live run in :mod:`tools.bench.fuzz_live`.

Each example is sent on a fresh DEALER, after a valid hello (with its own actor id) or
without one; a ping follows it, and its answer marks the fuzzed message as processed (the
ROUTER handles one connection's messages in order).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.core.codec import ALLOWED_DTYPES, decode, encode
from data.core.schema import (FIELD_BOUNDS, INT64_BOUNDS, MESSAGE_SCHEMAS, OBS_STATE, STEP_ARRAYS,
                              STEP_BOUNDS)
from data.core.spec import EnvSpec

SPEC = EnvSpec(state_dim=3, action_dim=2, cameras={"front": (4, 4, 3)})
HASH = "fuzz"
SELF = "$self"  # placeholder for the session's actor id in a generated header
#: replies a learner may send to a client request
REPLY_TYPES = {"welcome", "act_reply", "job", "no_job", "ack", "pong", "weights", "error",
               "batch_rejected"}

_EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**53 - 1, 2**53, 2**62, 2**63 - 2, 2**63 - 1, -(2**63),
              2**64 - 1]
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(_EDGE_INTS))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12),
                    st.binary(max_size=12))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                        | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)


@dataclass
class Fuzzed:
    """One generated message: a header dict (packed by the target) or raw frames."""

    header: dict | None
    buffers: list[bytes] = field(default_factory=list)
    raw: list[bytes] | None = None
    handshake: bool = True
    resend_from: int = 0  # of the session's hello
    more: list["Fuzzed"] = field(default_factory=list)  # sent after this one, same session

    def frames(self, actor_id: str) -> list[bytes]:
        if self.raw is not None:
            return list(self.raw)
        h = {k: (actor_id if v == SELF else v) for k, v in self.header.items()}
        return [msgpack.packb(h, use_bin_type=True), *self.buffers]


def _valid_value(key: str, typ: type):
    if typ is int:
        lo, hi = FIELD_BOUNDS.get(key, INT64_BOUNDS)
        return st.one_of(st.integers(max(lo, -1), min(hi, 64)), st.sampled_from([lo, hi]))
    if typ is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if typ is bool:
        return st.booleans()
    if typ is str:
        return st.text(max_size=16)
    if typ is list:
        return st.lists(st.text(max_size=8), max_size=6)
    return st.dictionaries(st.text(max_size=6), scalars, max_size=3)


def _array(dtype: str, shape: tuple[int, ...], draw) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "b":
        flat = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        flat = np.array(draw(st.lists(st.one_of(st.integers(0, 8), st.sampled_from(
            [int(info.min), int(info.max), -1])), min_size=n, max_size=n)), dtype=object)
        flat = flat.astype(dt) if n else np.zeros(0, dt)
    else:
        flat = np.array(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)) or [], dt)
    return flat.reshape(shape)


def _valid_arrays(draw, msg_type: str) -> dict[str, np.ndarray]:
    n = draw(st.integers(1, 3))
    obs = {OBS_STATE: (np.float32, (n, SPEC.state_dim))}
    for cam, shape in SPEC.cameras.items():
        obs["observation.images." + cam] = (np.uint8, (n, *shape))
    if msg_type == "act":
        return {k: np.zeros(s, dt) + draw(st.integers(0, 3)) for k, (dt, s) in obs.items()}
    if msg_type != "transitions":
        return {}
    out = {k: np.zeros(s, dt) for k, (dt, s) in obs.items()}
    out["action"] = np.zeros((n, SPEC.action_dim), np.float32)
    for k, dt in STEP_ARRAYS.items():
        if k == "action":
            continue
        if k in STEP_BOUNDS or dt == "bool":
            out[k] = _array(dt, (n,), draw)  # edge values: ids near the int64 limit, ...
        else:
            out[k] = np.zeros(n, dt)
    if draw(st.booleans()):  # a well-formed episode start instead of random ids
        out.update(episode=np.zeros(n, np.int64), step=np.arange(n, dtype=np.int64),
                   is_last=np.zeros(n, bool), terminated=np.zeros(n, bool),
                   truncated=np.zeros(n, bool), policy_version=np.zeros(n, np.int64),
                   chunk_index=np.zeros(n, np.int64), group_id=np.full(n, -1, np.int64))
    return out


#: what an actor sends (generated more often than the learner's own message types)
_REQUESTS = ("hello", "act", "transitions", "transitions", "ping", "get_weights", "get_job", "bye")
_MUTATIONS = ("field_any", "field_drop", "field_extra", "version", "type", "dtype", "shape",
              "shape", "buffer", "array_extra", "array_drop", "tasks", "meta", "int_edge",
              "int_edge", "zero_d")


@st.composite
def messages(draw) -> Fuzzed:
    """A session: a hello (or none) with a resend position, then 1-3 messages of any type,
    valid or mutated, or raw garbage."""
    resend_from = draw(st.sampled_from([0] * 8 + [e for e in _EDGE_INTS if 0 <= e < 2**63]))
    first, *more = draw(st.lists(_message(resend_from), min_size=1, max_size=3))
    first.resend_from, first.more = resend_from, more
    return first


@st.composite
def _message(draw, resend_from: int = 0) -> Fuzzed:
    kind = draw(st.sampled_from(["valid", "valid", "mutated", "mutated", "mutated", "garbage"]))
    handshake = draw(st.sampled_from([True, True, True, False]))
    if kind == "garbage":
        if draw(st.booleans()):
            return Fuzzed(None, raw=draw(st.lists(st.binary(max_size=48), min_size=1, max_size=4)),
                          handshake=handshake)
        head = msgpack.packb(draw(anything), use_bin_type=True)
        return Fuzzed(None, raw=[head, *draw(st.lists(st.binary(max_size=16), max_size=2))],
                      handshake=handshake)
    msg_type = draw(st.sampled_from(sorted(MESSAGE_SCHEMAS) + 3 * list(_REQUESTS)))
    schema = MESSAGE_SCHEMAS[msg_type]
    header: dict = {"v": 1, "type": msg_type}
    for key, typ in schema.fields.items():
        header[key] = draw(_valid_value(key, typ))
    if msg_type == "hello":
        header.update(config_hash=HASH, resend_from=0, actor_id=draw(st.sampled_from([SELF, "other"])))
    if msg_type == "transitions":
        header.update(actor_id=SELF, first_seq=draw(st.sampled_from([0, 0, 1, 5, resend_from])))
    arrays = _valid_arrays(draw, msg_type)
    if msg_type in ("act", "transitions") and arrays:
        n = len(next(iter(arrays.values())))
        header["tasks"] = [""] * n
        if msg_type == "transitions":
            header["last_seq"] = header["first_seq"] + n - 1
    meta = [[k, a.dtype.name, list(a.shape)] for k, a in arrays.items()]
    buffers = [a.tobytes() for a in arrays.values()]
    if kind == "mutated":
        for m in draw(st.lists(st.sampled_from(_MUTATIONS), min_size=1, max_size=3)):
            keys = [k for k in header if k not in ("v", "type")]
            if m == "field_any" and keys:
                header[draw(st.sampled_from(keys))] = draw(anything)
            elif m == "field_drop" and keys:
                header.pop(draw(st.sampled_from(keys)))
            elif m == "field_extra":
                header[draw(st.text(max_size=6))] = draw(anything)
            elif m == "version":
                header["v"] = draw(st.sampled_from([1.0, True, 2, 0, "1", None, -1, 2**64 - 1]))
            elif m == "type":
                header["type"] = draw(st.one_of(st.text(max_size=10), anything))
            elif m == "dtype" and meta:
                i = draw(st.integers(0, len(meta) - 1))
                meta[i][1] = draw(st.sampled_from(sorted(ALLOWED_DTYPES) + ["object", "<U4", "V8", 7]))
            elif m == "shape" and meta:
                names = [e[0] for e in meta]
                pick = draw(st.sampled_from(names + [n for n in ("reward", OBS_STATE) if n in names] * 4))
                i = names.index(pick)
                old_shape = meta[i][2] if isinstance(meta[i][2], list) else []
                meta[i][2] = draw(st.one_of(
                    st.just([]),                                    # 0-d where a batch is expected
                    st.just(old_shape[1:]), st.just(old_shape[:1]),  # a dim lost
                    st.lists(st.sampled_from([0, 1, 2, 3, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -1]),
                             max_size=9),
                    anything))
                shape = meta[i][2]
                if draw(st.integers(0, 3)) and isinstance(shape, list) and all(
                        isinstance(d, int) and d >= 0 for d in shape):
                    dt = np.dtype(meta[i][1]) if meta[i][1] in ALLOWED_DTYPES else np.dtype("uint8")
                    size = int(np.prod(shape, dtype=object)) * dt.itemsize
                    if size <= 1 << 16:  # a consistent claim (zero bytes for [0, 2**62])
                        buffers[i] = bytes(size) if size != len(buffers[i]) else buffers[i]
            elif m == "zero_d" and meta:  # a scalar where a batch [N, ...] is expected
                names = [e[0] for e in meta]
                i = names.index(draw(st.sampled_from(names + ["reward"] * len(names)))
                                if "reward" in names else names[0])
                meta[i][2] = []
                dt = np.dtype(meta[i][1]) if meta[i][1] in ALLOWED_DTYPES else np.dtype("uint8")
                buffers[i] = bytes(dt.itemsize)
            elif m == "int_edge":
                ikeys = [k for k in keys if isinstance(header.get(k), int)]
                if ikeys:
                    k = draw(st.sampled_from(ikeys))
                    header[k] = draw(st.sampled_from(_EDGE_INTS))
                    if k == "first_seq" and isinstance(header.get("tasks"), list):
                        # msgpack carries ints up to 2**64 - 1
                        header["last_seq"] = min(header[k] + len(header["tasks"]) - 1, 2**64 - 1)
            elif m == "buffer" and buffers:
                i = draw(st.integers(0, len(buffers) - 1))
                buffers[i] = buffers[i][: draw(st.integers(0, len(buffers[i])))] + draw(
                    st.binary(max_size=8))
            elif m == "array_extra":
                meta.append([draw(st.text(max_size=20)), "float32", [1]])
                buffers.append(bytes(4))
            elif m == "array_drop" and meta:
                i = draw(st.integers(0, len(meta) - 1))
                meta.pop(i)
                buffers.pop(i)
            elif m == "tasks":
                header["tasks"] = draw(st.one_of(st.lists(st.text(max_size=4), max_size=6),
                                                 st.lists(anything, max_size=3)))
            elif m == "meta":
                meta = draw(st.one_of(anything, st.lists(anything, max_size=3)))
                break  # later mutations edit a well-formed metadata list
    header["arrays"] = meta
    return Fuzzed(header, buffers, handshake=handshake)


class FuzzTarget:
    """A real learner service on loopback (MLP policy, inference thread, replay ring; with
    ``store_dir`` also a LeRobot episode store, as a training learner has: durable acks)."""

    def __init__(self, port: int = 0, pub_port: int = 0, timeout_s: float = 15.0,
                 store_dir: str | None = None):
        import torch

        from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
        from data.replay import ReplayBuffer
        from learner.inference import InferenceServer
        from learner.ingest import Ingest
        from learner.service import LearnerService
        from learner.weights import WeightPublisher

        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context()
        policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(8,), cnn_channels=(2,), image_embed_dim=4), SPEC)
        self.spec = SPEC.with_extras(policy.extras_spec())
        self.store = None
        if store_dir is not None:
            from data.store import EpisodeStore

            self.store = EpisodeStore(store_dir, self.spec, video=False).start()
        self.ingest = Ingest(ReplayBuffer(5000, self.spec), store=self.store)
        box = {}
        self.svc = LearnerService(
            ctx=self.ctx, spec=self.spec, config_hash=HASH, ingest=self.ingest,
            submit_act=lambda r: box["inf"].submit(r), get_version=lambda: box["w"].version,
            get_weights=lambda: box["w"].latest(), port=port or _free_port(),
            pub_port=pub_port or _free_port(), max_message_bytes=1 << 20)
        self.inf = InferenceServer(policy, reply=self.svc.reply, active_actors=self.svc.active_actors,
                                   device=torch.device("cpu"), batch_window_ms=0.0)
        box["inf"], box["w"] = self.inf, WeightPublisher(self.inf.set_weights, self.svc.publish)
        box["w"].publish(policy.trainable_state_dict(), version=1)
        self.svc.start()
        self.inf.start()
        self._ids = itertools.count()
        self.sent = 0
        self.replies: dict[str, int] = {}

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.svc.port}")
        return s

    def _recv(self, s: zmq.Socket):
        assert s.poll(self.timeout_ms), "the learner did not answer"
        return decode(s.recv_multipart())  # raises if a reply does not decode

    def check(self, fz: Fuzzed) -> None:
        """Send one fuzzed message; assert it is answered with decodable replies or dropped,
        and that the learner is alive and raised nothing unchecked."""
        actor_id = f"fz-{next(self._ids)}"
        s = self._dealer()
        try:
            if fz.handshake:
                s.send_multipart([msgpack.packb({
                    "v": 1, "type": "hello", "actor_id": actor_id, "config_hash": HASH,
                    "resend_from": fz.resend_from, "arrays": []}, use_bin_type=True)])
                self._count(self._recv(s))
            for one in [fz, *fz.more]:
                s.send_multipart(one.frames(actor_id))
            s.send_multipart(encode("ping", {"t": -1.0}))  # marks the end of the fuzzed reply
            while True:
                r = self._recv(s)
                self._count(r)
                if (r.type == "pong" and r["t"] == -1.0) or (
                        r.type == "error" and r["code"] == "handshake_required"
                        and "'ping'" in r["message"]):
                    break
            self.sent += 1
        finally:
            s.close(0)
        assert self.svc.is_alive(), f"the socket thread died: {self.svc.error!r}"
        assert self.svc.counters["internal_errors"] == 0, "a message raised past the checks"

    def _count(self, r) -> None:
        assert r.type in REPLY_TYPES, f"unexpected reply type {r.type!r}"
        key = r.type if r.type not in ("error", "batch_rejected") else r.type + ":" + r["code"]
        self.replies[key] = self.replies.get(key, 0) + 1

    def served(self) -> None:
        """A real client still gets hello, act and an acknowledged batch through."""
        from data.core.transitions import TransitionBatch

        real = f"real-{next(self._ids)}"
        s = self._dealer()
        try:
            s.send_multipart(encode("hello", {"actor_id": real, "config_hash": HASH, "resend_from": 0}))
            assert self._recv(s).type == "welcome"
            obs = {OBS_STATE: np.zeros((1, SPEC.state_dim), np.float32),
                   "observation.images.front": np.zeros((1, 4, 4, 3), np.uint8)}
            s.send_multipart(encode("act", {"req_id": 1, "deterministic": True, "tasks": [""]}, obs))
            r = self._recv(s)
            assert r.type == "act_reply", r.fields
            n = 3
            arrays = {OBS_STATE: np.zeros((n, SPEC.state_dim), np.float32),
                      "observation.images.front": np.zeros((n, 4, 4, 3), np.uint8),
                      "action": np.zeros((n, SPEC.action_dim), np.float32),
                      "reward": np.ones(n, np.float32), "step": np.arange(n, dtype=np.int64),
                      **{k: np.zeros(n, dt) for k, dt in STEP_ARRAYS.items()
                         if k not in ("action", "reward", "step")}}
            for name, (dt, shape) in self.spec.extras.items():
                arrays["extra." + name] = np.zeros((n, *shape), dt)
            s.send_multipart(TransitionBatch(real, 0, arrays, [""] * n).to_frames())
            r = self._recv(s)
            assert r.type == "ack" and r["received_seq"] == n - 1, r.fields
        finally:
            s.close(0)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.inf.stop()
        self.svc.stop()
        self.inf.join(2)
        self.svc.join(2)
        self.ctx.destroy(0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(examples: int, *, seed: int | None = None, store_dir: str | None = None) -> dict:
    """Fuzz a fresh learner with ``examples`` messages; raises on the first failure
    (hypothesis shrinks it to a minimal message first; once the service is broken every
    later example fails too, so read the logged cause)."""
    target = FuzzTarget(store_dir=store_dir)
    t0 = time.monotonic()
    try:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
                  suppress_health_check=list(HealthCheck))
        @given(messages())
        def prop(fz):
            target.check(fz)

        prop()
        target.served()
        return {"sent": target.sent, "seconds": round(time.monotonic() - t0, 1),
                "rejected": target.svc.counters["rejected"], "replies": dict(sorted(target.replies.items())),
                "internal_errors": target.svc.counters["internal_errors"]}
    finally:
        target.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=None, help="derandomize (repeatable run)")
    ap.add_argument("--store", action="store_true",
                    help="with a LeRobot episode store in a temporary folder (durable acks)")
    args = ap.parse_args()
    import json
    import logging
    import tempfile

    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = f"{tmp}/dataset" if args.store else None
        print(json.dumps(run(args.examples, seed=args.seed, store_dir=store_dir), indent=1))


if __name__ == "__main__":
    main()
