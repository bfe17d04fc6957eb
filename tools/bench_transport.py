#!/usr/bin/env python
"""Transport benchmark: Tandem's act and transition-ingest paths against raw pyzmq.

Everything runs on loopback with ports picked by the OS (bind to port 0).

(a) **act round trip**: a real :class:`learner.service.LearnerService` and
    :class:`learner.inference.InferenceServer` (with a policy whose ``act()`` returns zeros of
    the right shape at once, so the figure is transport overhead, not model time) answering a
    real :meth:`actor.client.LearnerClient.act` with a 224x224x3 uint8 image plus a small float32
    state. Baseline: raw pyzmq REQ/REP carrying the same bytes (a frame of image bytes and a
    frame of state bytes) and replying with as many bytes as Tandem's action chunk.
    ``act_overhead_ratio = tandem_p50 / raw_p50``.

(b) **transition ingest**: a real LearnerClient streams TransitionBatch messages from its on-disk
    :class:`actor.spool.Spool` (fsync disabled unless ``--spool-fsync``; the spool is filled
    before each timed round, outside the timing, and its append rate is reported separately) to
    LearnerService -> validate -> Ingest -> ReplayBuffer with acks (``max_in_flight`` window).
    The replay buffer's pages are faulted in first (steady state of a buffer that has wrapped;
    ``--cold-buffer`` measures a fresh one). Baseline: raw pyzmq PUSH/PULL, no acks, of the same
    encoded frames, each message prepared (untimed) in its own memory laid out as a spool blob.
    ``ingest_ratio = tandem_MB_s / raw_MB_s`` (payload = the message frames' bytes, MB = 1e6 B).

Method: the server side (Tandem stacks and raw servers) runs in this process, the client side
(LearnerClients, raw REQ/PUSH) in a spawned child process (``--client-in-process`` puts it in a
thread here instead), each side with its own ZMQ context, as an actor and a learner would be.
Raw and Tandem rounds are interleaved (ABBA order) after warm-up, and the reported figures are
medians over rounds; cross-process stage timestamps use ``time.perf_counter`` (CLOCK_MONOTONIC).
The only additions to the product path are list appends recording timestamps in the
``submit_act``/``reply`` callables the bench hands to the service and inference threads.

Besides wall-clock figures it reports the CPU time both processes spent (per act call, per MB),
by thread, from /proc/<pid>/task/<tid>/schedstat: on a CPU-starved machine throughput follows
CPU cost, and the per-thread split shows which side and stage pays it.

``--profile`` adds two Tandem-only passes after the measurement: one with per-stage timers
(monkeypatched wrappers, this process only) and one under cProfile (server process: Python 3.12's
cProfile sees every thread; client process: its own profile).

Usage::

    python tools/bench_transport.py                 # human-readable report
    python tools/bench_transport.py --json          # exactly one JSON object on stdout
    python tools/bench_transport.py --profile --act-rounds 3 --ingest-rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import multiprocessing as mp
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import zmq

from actor.client import LearnerClient
from actor.spool import Spool
from data.core.codec import encode_to_bytes, frames_from_bytes
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from data.transitions import TransitionBatch
from data.core.spec import EnvSpec, config_hash

HOST = "127.0.0.1"
ACT_ACTOR = "bench-act"
INGEST_ACTOR = "bench-ingest"
TARGET_ACT_RATIO = 1.3
TARGET_INGEST_RATIO = 0.8

perf = time.perf_counter


# ---- shared set-up (both processes) --------------------------------------------------------

def act_spec(cfg: dict) -> EnvSpec:
    s = cfg["act_image"]
    return EnvSpec(state_dim=cfg["state_dim"], action_dim=cfg["action_dim"], cameras={"front": (s, s, 3)})


def ingest_spec(cfg: dict) -> EnvSpec:
    s = cfg["ingest_image"]
    return EnvSpec(state_dim=cfg["state_dim"], action_dim=cfg["action_dim"],
                   cameras={f"cam{i}": (s, s, 3) for i in range(cfg["cameras"])})


def spec_hash(spec: EnvSpec, cfg: dict) -> str:
    return config_hash(spec, env_name="bench", policy_name="zeros", chunk=cfg["chunk"])


def act_observation(cfg: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    s = cfg["act_image"]
    return {
        OBS_STATE: rng.standard_normal((1, cfg["state_dim"]), dtype=np.float32),
        OBS_IMAGE_PREFIX + "front": rng.integers(0, 256, (1, s, s, 3), dtype=np.uint8),
    }


def ingest_images(cfg: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    n, s = cfg["batch_records"], cfg["ingest_image"]
    return {OBS_IMAGE_PREFIX + f"cam{i}": rng.integers(0, 256, (n, s, s, 3), dtype=np.uint8)
            for i in range(cfg["cameras"])}


def make_batch(cfg: dict, images: dict[str, np.ndarray], first_seq: int, episode: int) -> TransitionBatch:
    """One episode of n-1 steps (the last one truncated) plus its is_last record."""
    n = cfg["batch_records"]
    rng = np.random.default_rng(episode)
    truncated = np.zeros(n, bool)
    truncated[n - 2] = True
    is_last = np.zeros(n, bool)
    is_last[n - 1] = True
    arrays = {
        OBS_STATE: rng.standard_normal((n, cfg["state_dim"]), dtype=np.float32),
        **images,
        "action": rng.uniform(-1, 1, (n, cfg["action_dim"])).astype(np.float32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "terminated": np.zeros(n, bool),
        "truncated": truncated,
        "intervened": np.zeros(n, bool),
        "is_last": is_last,
        "success": np.zeros(n, bool),
        "policy_version": np.zeros(n, np.int64),
        "episode": np.full(n, episode, np.int64),
        "step": np.arange(n, dtype=np.int64),
    }
    return TransitionBatch(INGEST_ACTOR, first_seq, arrays, [""] * n)


def prefault(obj: Any, depth: int = 3) -> int:
    """Fault in the pages of every numpy array reachable from ``obj``'s attributes (dicts,
    lists, nested objects, ``depth`` levels) by rewriting one byte per page with its own value
    (contents unchanged); returns the bytes covered. Generic on purpose: the replay buffer's
    internal layout is not the bench's business."""
    seen: set[int] = set()

    def walk(x: Any, d: int) -> int:
        if id(x) in seen:
            return 0
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            if x.flags.writeable and x.flags.c_contiguous and x.dtype != object and x.nbytes:
                b = x.reshape(-1).view(np.uint8)
                b[::4096] += 0  # a write per page: maps it, keeps the value
                return x.nbytes
            return 0
        if d <= 0:
            return 0
        if isinstance(x, dict):
            return sum(walk(v, d - 1) for v in x.values())
        if isinstance(x, (list, tuple)) and len(x) <= 64:
            return sum(walk(v, d - 1) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, type):
            return sum(walk(v, d - 1) for v in vars(x).values())
        return 0

    return walk(obj, depth)


def frames_nbytes(frames) -> int:
    return sum(memoryview(getattr(f, "buffer", f)).nbytes for f in frames)


def thread_cpu(labels: dict[int, str] | None = None, pid: int | str = "self") -> dict[str, float]:
    """CPU seconds used so far by each thread of this process, by label (Linux /proc; else {}).

    Reads /proc/self/task/<tid>/schedstat (nanoseconds), falling back to the tick-granular
    utime+stime of .../stat. Python threads are named by their Thread name (or
    ``labels[native_id]``), others by their kernel name (libzmq's I/O threads: ZMQbg/...);
    threads sharing a label are summed."""
    names = {}
    if pid == "self":
        names = {t.native_id: "pyzmq-gc" if type(t).__name__ == "GarbageCollectorThread" else t.name
                 for t in threading.enumerate() if t.native_id is not None}
    names.update(labels or {})
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            try:
                with open(f"{base}/schedstat") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
        label = names.get(int(tid), comm)
        out[label] = out.get(label, 0.0) + cpu
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def stats_text(prof: cProfile.Profile, top: int, sort: str = "tottime") -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats(sort).print_stats(top)
    return buf.getvalue()


# ---- client side (child process, or a thread with --client-in-process) ---------------------

class ClientWorker:
    """The actor side: a LearnerClient per Tandem stack, raw REQ and PUSH sockets."""

    def __init__(self, cfg: dict, ports: dict[str, int], tmpdir: str):
        self.cfg = cfg
        self.ctx = zmq.Context()
        tmp = Path(tmpdir)
        common = dict(ctx=self.ctx, host=HOST, timeout_s=10.0, heartbeat_s=30.0)
        self.act_client = LearnerClient(
            port=ports["tandem_act"], actor_id=ACT_ACTOR, config_hash=spec_hash(act_spec(cfg), cfg),
            spool=Spool(tmp / "act-spool", fsync=False), **common)
        self.spool = Spool(tmp / "ingest-spool", max_bytes=1 << 40, fsync=cfg["spool_fsync"])
        self.ing_client = LearnerClient(
            port=ports["tandem_ingest"], actor_id=INGEST_ACTOR,
            config_hash=spec_hash(ingest_spec(cfg), cfg), spool=self.spool,
            max_in_flight=cfg["max_in_flight"], **common)
        self.act_client.connect(give_up_after_s=30)
        self.ing_client.connect(give_up_after_s=30)
        self.req = self.ctx.socket(zmq.REQ)
        self.req.setsockopt(zmq.LINGER, 0)
        self.req.connect(f"tcp://{HOST}:{ports['raw_act']}")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://{HOST}:{ports['raw_ingest']}")
        self.obs = act_observation(cfg)
        self.images = ingest_images(cfg)
        self.episode = 0
        self.raw_seq = 0
        self.raw_msgs: list = []

    def act(self, kind: str, n: int) -> dict:
        t0s = np.empty(n)
        t1s = np.empty(n)
        if kind == "tandem":
            client, obs, tasks = self.act_client, self.obs, [""]
            for i in range(n):
                t0 = perf()
                client.act(obs, tasks)
                t1s[i] = perf()
                t0s[i] = t0
        else:
            img = self.obs[OBS_IMAGE_PREFIX + "front"]
            state = self.obs[OBS_STATE]
            frames = [memoryview(img.reshape(-1).view(np.uint8)),
                      memoryview(state.reshape(-1).view(np.uint8))]
            req = self.req
            for i in range(n):
                t0 = perf()
                req.send_multipart(frames, copy=False)
                req.recv(copy=False)
                t1s[i] = perf()
                t0s[i] = t0
        return {"t0": t0s, "t1": t1s}

    def fill(self, n: int) -> dict:
        """Append n batches to the spool (untimed for the stream; its own rate is reported)."""
        payload, append_s = 0, 0.0
        for _ in range(n):
            batch = make_batch(self.cfg, self.images, self.spool.next_seq, self.episode)
            self.episode += 1
            payload += frames_nbytes(batch.to_frames())
            t0 = perf()
            self.spool.append(batch)
            append_s += perf() - t0
        return {"payload": payload, "append_s": append_s, "last_seq": self.spool.next_seq - 1}

    def ingest_tandem(self, timeout_s: float = 120.0) -> dict:
        """Stream the whole spool until every batch is acknowledged."""
        client, spool = self.ing_client, self.spool
        t0 = perf()
        client.flush()
        while spool.pending():
            # Block (GIL released) until the learner says something, then let the client
            # process every ack and refill its in-flight window, as ActorLoop's poll(0) does.
            client.sock.poll(50)
            client.poll(0.0)
            if perf() - t0 > timeout_s:
                raise TimeoutError(f"ingest stream not acknowledged after {timeout_s}s")
        return {"t0": t0, "t1": perf()}

    def prepare_raw(self, n: int) -> dict:
        msgs = []
        for _ in range(n):
            # Each message in its own memory, laid out exactly as the spool's blobs are (frames
            # are views into one bytes object), so that the sender does not re-send cache-hot
            # arrays while Tandem sends a fresh blob per batch.
            frames = make_batch(self.cfg, self.images, self.raw_seq, self.raw_seq).to_frames()
            msgs.append(frames_from_bytes(encode_to_bytes(frames)))
            self.raw_seq += self.cfg["batch_records"]
        self.raw_msgs = msgs
        return {"payload": sum(frames_nbytes(m) for m in msgs)}

    def ingest_raw(self) -> dict:
        msgs, self.raw_msgs = self.raw_msgs, []
        payload = sum(frames_nbytes(m) for m in msgs)
        push = self.push
        t0 = perf()
        for frames in msgs:
            push.send_multipart(frames, copy=False)
        return {"t0": t0, "t_sent": perf(), "payload": payload}

    def close(self) -> None:
        self.act_client.close()
        self.ing_client.close()
        self.ctx.destroy(linger=0)


def client_worker_main(conn, cfg: dict, ports: dict[str, int], tmpdir: str, can_profile: bool) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        worker = ClientWorker(cfg, ports, tmpdir)
    except Exception:
        conn.send({"ok": False, "error": traceback.format_exc()})
        return
    conn.send({"ok": True})
    while True:
        cmd = conn.recv()
        if cmd["op"] == "stop":
            worker.close()
            conn.send({"ok": True})
            return
        try:
            prof = cProfile.Profile() if cmd.get("profile") and can_profile else None
            if prof:
                prof.enable()
            res = getattr(worker, cmd["op"])(**cmd.get("kw", {}))
            if prof:
                prof.disable()
                res["profile"] = stats_text(prof, cfg["profile_top"])
            conn.send({"ok": True, **res})
        except Exception:
            conn.send({"ok": False, "error": traceback.format_exc()})


class WorkerHandle:
    def __init__(self, cfg: dict, ports: dict[str, int], tmpdir: str, in_process: bool):
        self.in_process = in_process
        if in_process:
            self.conn, child = mp.Pipe()
            self.proc = threading.Thread(target=client_worker_main, args=(child, cfg, ports, tmpdir, False),
                                         name="bench-client", daemon=True)
        else:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=client_worker_main, args=(child, cfg, ports, tmpdir, True),
                                    name="bench-client", daemon=True)
        self.proc.start()
        self._get(120.0)

    def _get(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError("bench client worker died")
            if time.monotonic() > deadline:
                raise TimeoutError("bench client worker did not answer")
        res = self.conn.recv()
        if not res.get("ok"):
            raise RuntimeError(f"bench client worker failed:\n{res.get('error')}")
        return res

    def call(self, op: str, timeout: float = 300.0, profile: bool = False, **kw) -> dict:
        self.conn.send({"op": op, "kw": kw, "profile": profile})
        return self._get(timeout)

    def client_threads(self) -> dict[str, float]:
        """CPU seconds so far of the worker process's threads (empty for an in-process worker,
        whose threads are counted with this process's)."""
        if self.in_process:
            return {}
        pid = self.proc.pid
        # The child's only Python thread besides its main one is pyzmq's garbage collector,
        # which frees zero-copy send buffers.
        return {"client:" + ("pyzmq-gc" if k == "python" else k): v
                for k, v in thread_cpu({pid: "main"}, pid).items()}

    def stop(self) -> None:
        try:
            self.conn.send({"op": "stop"})
            self._get(10.0)
        except Exception:
            pass
        self.proc.join(timeout=10)


# ---- server side (this process) ------------------------------------------------------------

class ZeroPolicy:
    """Returns zero action chunks at once; records when each act() started."""

    capabilities = frozenset()

    def __init__(self, chunk: int, action_dim: int):
        import torch

        self.torch = torch
        self.chunk_size = chunk
        self.action_dim = action_dim
        self.t_act: list[float] = []

    def act(self, obs, *, deterministic: bool = False):
        from agents.base import ActionChunk

        self.t_act.append(perf())
        b = obs[OBS_STATE].shape[0]
        return ActionChunk(self.torch.zeros(b, self.chunk_size, self.action_dim))

    def trainable_state_dict(self):
        return {}

    def load_trainable_state_dict(self, state) -> None:
        pass


class TandemStack:
    """LearnerService + InferenceServer + Ingest + ReplayBuffer, built as learner/app.py does."""

    def __init__(self, spec: EnvSpec, chash: str, cfg: dict, buffer_capacity: int):
        import torch

        from data.replay import ReplayBuffer
        from learner.inference import InferenceServer
        from learner.ingest import Ingest
        from learner.service import LearnerService

        self.ctx = zmq.Context()
        self.policy = ZeroPolicy(cfg["chunk"], cfg["action_dim"])
        self.buffer = ReplayBuffer(buffer_capacity, spec)
        self.ingest = Ingest(self.buffer, store_transitions=True)
        self.t_recv: list[float] = []
        self.t_reply: list[float] = []
        self.service = LearnerService(
            ctx=self.ctx, spec=spec, config_hash=chash, ingest=self.ingest,
            submit_act=self._submit, get_version=lambda: 0, get_weights=lambda: None,
            host=HOST, port=0, pub_port=0,
        )
        self.inference = InferenceServer(
            self.policy, reply=self._reply, active_actors=self.service.active_actors,
            device=torch.device("cpu"),
        )
        self.service.start()
        self.inference.start()

    def _submit(self, req) -> None:
        self.t_recv.append(req.t_recv)
        self.inference.submit(req)

    def _reply(self, identity: bytes, frames: list) -> None:
        self.t_reply.append(perf())
        self.service.reply(identity, frames)

    def clear_marks(self) -> None:
        self.t_recv.clear()
        self.t_reply.clear()
        self.policy.t_act.clear()

    def close(self) -> None:
        self.inference.stop()
        self.service.stop()
        self.inference.join(timeout=5)
        self.service.join(timeout=5)
        self.ctx.destroy(linger=0)


class RawRep(threading.Thread):
    def __init__(self, ctx: zmq.Context, reply: bytes):
        super().__init__(name="bench-raw-rep", daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{HOST}:0")
        self.port = int(self.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
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
        self.sock.bind(f"tcp://{HOST}:0")
        self.port = int(self.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
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


# ---- measurement ---------------------------------------------------------------------------

SERVER_LABELS: dict[int, str] = {}


class Meter:
    """CPU time, per thread and in total, of both processes between start and stop."""

    def __init__(self, worker: "WorkerHandle"):
        self.worker = worker
        self.th0 = self._now()

    def _now(self) -> dict[str, float]:
        return {**thread_cpu(SERVER_LABELS), **self.worker.client_threads()}

    def stop(self) -> tuple[float, dict[str, float]]:
        delta = cpu_delta(self.th0, self._now())
        delta.pop("server-main", None)  # the bench's own driver thread (reads /proc, waits)
        return sum(delta.values()), delta


def _add_threads(acc: dict[str, float], delta: dict[str, float]) -> None:
    for k, v in delta.items():
        acc[k] = acc.get(k, 0.0) + v


def _per_unit(acc: dict[str, float], units: float, scale: float) -> dict[str, float]:
    total = sum(acc.values()) or 1.0
    return {k: v * scale / units for k, v in sorted(acc.items(), key=lambda kv: -kv[1]) if v >= 0.02 * total}


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q))


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def bench_act(cfg: dict, worker: WorkerHandle, stack: TandemStack) -> dict:
    n, rounds = cfg["act_iters"], cfg["act_rounds"]
    for kind in ("raw", "tandem"):
        worker.call("act", kind=kind, n=cfg["act_warmup"])
    per: dict[str, list[dict]] = {"raw": [], "tandem": []}
    thread_acc: dict[str, dict[str, float]] = {"raw": {}, "tandem": {}}
    stages: dict[str, list[float]] = {}
    for r in range(rounds):
        for kind in (("raw", "tandem") if r % 2 == 0 else ("tandem", "raw")):
            stack.clear_marks()
            meter = Meter(worker)
            res = worker.call("act", kind=kind, n=n)
            cpu, threads = meter.stop()
            _add_threads(thread_acc[kind], threads)
            lat = (res["t1"] - res["t0"]) * 1e6
            per[kind].append({"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "mean_us": float(lat.mean()),
                              "cpu_us": cpu * 1e6 / n})
            if kind == "tandem" and len(stack.t_recv) == len(stack.policy.t_act) == len(stack.t_reply) == n:
                t_recv, t_act, t_reply = (np.asarray(v) for v in
                                          (stack.t_recv, stack.policy.t_act, stack.t_reply))
                for name, d in (
                    ("client act() -> service validated, queued", t_recv - res["t0"]),
                    ("queue -> inference thread at policy.act", t_act - t_recv),
                    ("policy.act + .numpy() + reply encode", t_reply - t_act),
                    ("outbox -> service -> ROUTER -> client returns", res["t1"] - t_reply),
                ):
                    stages.setdefault(name, []).append(_pct(d * 1e6, 50))
    out: dict[str, Any] = {"rounds": per}
    for kind in ("raw", "tandem"):
        for key in ("p50_us", "p99_us", "mean_us", "cpu_us"):
            out[f"{kind}_{key}"] = _median([x[key] for x in per[kind]])
    out["act_overhead_ratio"] = out["tandem_p50_us"] / out["raw_p50_us"]
    out["act_overhead_ratio_paired"] = _median(
        [t["p50_us"] / r["p50_us"] for t, r in zip(per["tandem"], per["raw"])])
    out["tandem_stage_p50_us"] = {k: _median(v) for k, v in stages.items()}
    out["cpu_us_per_call_by_thread"] = {k: _per_unit(v, n * rounds, 1e6) for k, v in thread_acc.items()}
    return out


def _ingest_round_tandem(worker: WorkerHandle, stack: TandemStack, fill: dict, profile=False) -> dict:
    meter = Meter(worker)
    res = worker.call("ingest_tandem", profile=profile)
    cpu, threads = meter.stop()
    got = stack.ingest.received.get(INGEST_ACTOR, -1)
    if got != fill["last_seq"]:
        raise RuntimeError(f"learner stored up to seq {got}, expected {fill['last_seq']}")
    dt = res["t1"] - res["t0"]
    return {"mb_s": fill["payload"] / dt / 1e6, "seconds": dt, "payload": fill["payload"],
            "cpu_ms_per_mb": cpu * 1e3 / (fill["payload"] / 1e6), "threads": threads,
            "profile": res.get("profile")}


def _ingest_round_raw(worker: WorkerHandle, sink: RawSink, n: int) -> dict:
    worker.call("prepare_raw", n=n)
    sink.reset(n)
    meter = Meter(worker)
    res = worker.call("ingest_raw")
    if not sink.done.wait(120):
        raise TimeoutError("raw sink did not receive every message")
    cpu, threads = meter.stop()
    if sink.nbytes != res["payload"]:
        raise RuntimeError(f"raw sink got {sink.nbytes} bytes, sender sent {res['payload']}")
    dt = sink.t_last - res["t0"]
    return {"mb_s": res["payload"] / dt / 1e6, "seconds": dt, "payload": res["payload"],
            "cpu_ms_per_mb": cpu * 1e3 / (res["payload"] / 1e6), "threads": threads}


def bench_ingest(cfg: dict, worker: WorkerHandle, stack: TandemStack, sink: RawSink) -> dict:
    n, rounds = cfg["ingest_batches"], cfg["ingest_rounds"]
    fill = worker.call("fill", n=cfg["ingest_warmup_batches"])
    _ingest_round_tandem(worker, stack, fill)
    _ingest_round_raw(worker, sink, cfg["ingest_warmup_batches"])
    per: dict[str, list[dict]] = {"raw": [], "tandem": []}
    append_mb_s = []
    for r in range(rounds):
        fill = worker.call("fill", n=n)
        append_mb_s.append(fill["payload"] / fill["append_s"] / 1e6)
        for kind in (("raw", "tandem") if r % 2 == 0 else ("tandem", "raw")):
            if kind == "tandem":
                res = _ingest_round_tandem(worker, stack, fill)
                res.pop("profile", None)
            else:
                res = _ingest_round_raw(worker, sink, n)
            per[kind].append(res)
    out: dict[str, Any] = {"rounds": per}
    by_thread = {}
    for kind in ("raw", "tandem"):
        acc: dict[str, float] = {}
        for x in per[kind]:
            _add_threads(acc, x.pop("threads"))
        by_thread[kind] = _per_unit(acc, sum(x["payload"] for x in per[kind]) / 1e6, 1e3)
    out["cpu_ms_per_mb_by_thread"] = by_thread
    for kind in ("raw", "tandem"):
        out[f"{kind}_mb_s"] = _median([x["mb_s"] for x in per[kind]])
        out[f"{kind}_cpu_ms_per_mb"] = _median([x["cpu_ms_per_mb"] for x in per[kind]])
    out["ingest_ratio"] = out["tandem_mb_s"] / out["raw_mb_s"]
    out["ingest_ratio_paired"] = _median([t["mb_s"] / r["mb_s"] for t, r in zip(per["tandem"], per["raw"])])
    out["batch_payload_bytes"] = per["tandem"][0]["payload"] // n if per["tandem"] else 0
    out["spool_append_mb_s"] = _median(append_mb_s)
    out["records_stored"] = stack.buffer.total_added
    out["rejected"] = stack.service.counters["rejected"]
    return out


# ---- profiling -----------------------------------------------------------------------------

class StageTimers:
    """Monkeypatched timing wrappers around the learner's per-message work (this process)."""

    def __init__(self):
        self.acc: dict[str, list[float]] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:  # the learner code changed: time what still exists
            return
        acc = self.acc.setdefault(name, [0, 0.0])

        def timed(*a, **kw):
            t0 = perf()
            try:
                return orig(*a, **kw)
            finally:
                acc[0] += 1
                acc[1] += perf() - t0

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, orig))

    def install(self) -> None:
        import data.replay
        import learner.inference
        import learner.ingest
        import learner.service

        s = learner.service
        self.wrap(s.LearnerService, "_handle", "service._handle (all per-message work)")
        self.wrap(s, "decode", "  codec.decode")
        self.wrap(s.LearnerService, "_on_transitions", "  _on_transitions")
        self.wrap(s.TransitionBatch, "validate", "    TransitionBatch.validate")
        self.wrap(learner.ingest.Ingest, "add", "    Ingest.add")
        self.wrap(data.replay.ReplayBuffer, "add", "      ReplayBuffer.add")
        self.wrap(learner.ingest.Ingest, "_track", "      Ingest._track")
        self.wrap(s.LearnerService, "_send", "    service._send (ack)")
        self.wrap(s, "check_obs", "  check_obs (act)")
        self.wrap(learner.inference.InferenceServer, "_serve", "inference._serve (act)")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def report(self, per: int) -> dict[str, dict[str, float]]:
        return {k: {"calls": c, "total_ms": t * 1e3, "us_per_unit": t * 1e6 / max(per, 1)}
                for k, (c, t) in self.acc.items() if c}


def bench_profile(cfg: dict, worker: WorkerHandle, act_stack: TandemStack, ing_stack: TandemStack) -> dict:
    n_b, n_a = cfg["ingest_batches"], cfg["act_iters"]
    out: dict[str, Any] = {}
    # Pass 1: stage timers (cheap wrappers; per batch / per act figures).
    timers = StageTimers()
    timers.install()
    try:
        fill = worker.call("fill", n=n_b)
        r = _ingest_round_tandem(worker, ing_stack, fill)
        out["ingest_timed_round_mb_s"] = r["mb_s"]
        out["ingest_wall_us_per_batch"] = r["seconds"] * 1e6 / n_b
        out["ingest_stages_per_batch"] = timers.report(n_b)
        timers.acc.clear()
        timers.uninstall()
        timers.install()
        res = worker.call("act", kind="tandem", n=n_a)
        out["act_wall_us_per_call"] = float(np.median(res["t1"] - res["t0"]) * 1e6)
        out["act_stages_per_call"] = timers.report(n_a)
    finally:
        timers.uninstall()
    # Pass 2: cProfile. In Python 3.12 one enabled profiler sees every thread of the process.
    top = cfg["profile_top"]
    prof = cProfile.Profile()
    fill = worker.call("fill", n=n_b)
    prof.enable()
    r = _ingest_round_tandem(worker, ing_stack, fill, profile=True)
    prof.disable()
    out["ingest_cprofile_server"] = stats_text(prof, top)
    out["ingest_cprofile_client"] = r.get("profile")
    prof = cProfile.Profile()
    prof.enable()
    res = worker.call("act", kind="tandem", n=n_a, profile=True)
    prof.disable()
    out["act_cprofile_server"] = stats_text(prof, top)
    out["act_cprofile_client"] = res.get("profile")
    return out


# ---- driver --------------------------------------------------------------------------------

def run_bench(cfg: dict) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("tandem").setLevel(logging.WARNING)
    load0 = os.getloadavg()
    tmpdir = tempfile.mkdtemp(prefix="tandem-bench-")
    stacks: list[TandemStack] = []
    raw_ctx = zmq.Context()
    raw_threads: list[threading.Thread] = []
    worker = None
    try:
        a_spec, i_spec = act_spec(cfg), ingest_spec(cfg)
        act_stack = TandemStack(a_spec, spec_hash(a_spec, cfg), cfg, buffer_capacity=2)
        ing_stack = TandemStack(i_spec, spec_hash(i_spec, cfg), cfg, buffer_capacity=cfg["buffer_capacity"])
        if not cfg["cold_buffer"]:
            # np.zeros maps pages lazily: the first write to each page of the ring faults it in
            # (slow on a VM whose memory was never touched). Fault them in now, so that the
            # figures are the steady state of a buffer that has wrapped; --cold-buffer measures
            # a fresh one.
            prefault(ing_stack.buffer)
        stacks += [act_stack, ing_stack]
        rep = RawRep(raw_ctx, b"\0" * (cfg["chunk"] * cfg["action_dim"] * 4))
        sink = RawSink(raw_ctx)
        raw_threads += [rep, sink]
        for t in raw_threads:
            t.start()
        SERVER_LABELS.clear()
        SERVER_LABELS.update({
            act_stack.service.native_id: "act:service", act_stack.inference.native_id: "act:inference",
            ing_stack.service.native_id: "ingest:service", ing_stack.inference.native_id: "ingest:inference",
            rep.native_id: "raw-rep", sink.native_id: "raw-sink", threading.get_native_id(): "server-main",
        })
        ports = {"tandem_act": act_stack.service.port, "tandem_ingest": ing_stack.service.port,
                 "raw_act": rep.port, "raw_ingest": sink.port}
        worker = WorkerHandle(cfg, ports, tmpdir, cfg["client_in_process"])
        result: dict[str, Any] = {}
        if cfg["act_rounds"] > 0:
            result["act"] = bench_act(cfg, worker, act_stack)
        if cfg["ingest_rounds"] > 0:
            result["ingest"] = bench_ingest(cfg, worker, ing_stack, sink)
        if cfg["profile"]:
            result["profile"] = bench_profile(cfg, worker, act_stack, ing_stack)
        result["load_avg"] = {"start": load0[0], "end": os.getloadavg()[0]}
        return result
    finally:
        if worker is not None:
            worker.stop()
        for t in raw_threads:
            t.stop_event.set()
            t.join(timeout=2)
        raw_ctx.destroy(linger=0)
        for s in stacks:
            s.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def summary(cfg: dict, result: dict) -> dict:
    """The flat JSON object: ratios, raw figures, config."""
    out: dict[str, Any] = {}
    if "act" in result:
        a = result["act"]
        out.update(
            act_overhead_ratio=a["act_overhead_ratio"],
            act_overhead_ratio_paired=a["act_overhead_ratio_paired"],
            act_raw_p50_us=a["raw_p50_us"], act_raw_p99_us=a["raw_p99_us"],
            act_tandem_p50_us=a["tandem_p50_us"], act_tandem_p99_us=a["tandem_p99_us"],
            act_raw_cpu_us=a["raw_cpu_us"], act_tandem_cpu_us=a["tandem_cpu_us"],
            act_tandem_stage_p50_us=a["tandem_stage_p50_us"],
            act_rounds={k: [x["p50_us"] for x in v] for k, v in a["rounds"].items()},
            act_cpu_us_per_call_by_thread=a["cpu_us_per_call_by_thread"],
        )
    if "ingest" in result:
        g = result["ingest"]
        out.update(
            ingest_ratio=g["ingest_ratio"], ingest_ratio_paired=g["ingest_ratio_paired"],
            ingest_raw_mb_s=g["raw_mb_s"], ingest_tandem_mb_s=g["tandem_mb_s"],
            ingest_raw_cpu_ms_per_mb=g["raw_cpu_ms_per_mb"],
            ingest_tandem_cpu_ms_per_mb=g["tandem_cpu_ms_per_mb"],
            ingest_rounds={k: [x["mb_s"] for x in v] for k, v in g["rounds"].items()},
            ingest_cpu_ms_per_mb_by_thread=g["cpu_ms_per_mb_by_thread"],
            ingest_batch_payload_bytes=g["batch_payload_bytes"],
            spool_append_mb_s=g["spool_append_mb_s"], records_stored=g["records_stored"],
            rejected=g["rejected"],
        )
    out["targets"] = {"act_overhead_ratio_max": TARGET_ACT_RATIO, "ingest_ratio_min": TARGET_INGEST_RATIO}
    if "act_overhead_ratio" in out:
        out["act_ok"] = out["act_overhead_ratio"] <= TARGET_ACT_RATIO
    if "ingest_ratio" in out:
        out["ingest_ok"] = out["ingest_ratio"] >= TARGET_INGEST_RATIO
    out["load_avg"] = result.get("load_avg")
    out["config"] = {k: v for k, v in cfg.items() if k != "json"}
    out["notes"] = [
        f"spool fsync {'ON' if cfg['spool_fsync'] else 'disabled'}; spool filled before each timed round",
        f"replay buffer {'cold (pages faulted in during the run)' if cfg['cold_buffer'] else 'pre-faulted'}",
        "cpu figures: CPU time of both processes (all threads but the bench driver's) per act call / per MB",
        "client side in " + ("a thread of the server process" if cfg["client_in_process"]
                             else "a separate process"),
        "MB = 1e6 bytes of message frames (header + arrays); medians over interleaved rounds",
    ]
    if "profile" in result:
        out["profile"] = {k: v for k, v in result["profile"].items() if "cprofile" not in k}
    return out


def _pairs(rounds: dict[str, list[dict]], key: str) -> str:
    return ", ".join(f"{r[key]:.0f}/{t[key]:.0f}" for r, t in zip(rounds["raw"], rounds["tandem"]))


def print_report(cfg: dict, result: dict, s: dict) -> None:
    w = sys.stdout.write
    where = "in-process thread" if cfg["client_in_process"] else "in a separate process"
    load = s["load_avg"]
    w(f"Tandem transport bench (loopback; client {where};"
      f" load avg {load['start']:.2f} -> {load['end']:.2f})\n")
    if "act" in result:
        a = result["act"]
        img, sd = cfg["act_image"], cfg["state_dim"]
        w(f"\n(a) act round trip: {img}x{img}x3 uint8 + float32[{sd}]"
          f" -> float32[{cfg['chunk']}x{cfg['action_dim']}];"
          f" {cfg['act_rounds']} rounds x {cfg['act_iters']} (warm-up {cfg['act_warmup']})\n")
        for label, k in (("raw REQ/REP ", "raw"), ("Tandem act()", "tandem")):
            w(f"    {label}  p50 {a[k + '_p50_us']:8.1f} us   p99 {a[k + '_p99_us']:8.1f} us"
              f"   CPU {a[k + '_cpu_us']:7.1f} us/call\n")
        ok = "OK" if a["act_overhead_ratio"] <= TARGET_ACT_RATIO else "MISSES"
        w(f"    act_overhead_ratio = {a['act_overhead_ratio']:.2f}"
          f" (paired median {a['act_overhead_ratio_paired']:.2f}); target <= {TARGET_ACT_RATIO}: {ok}\n")
        w(f"    per-round p50 raw / tandem: {_pairs(a['rounds'], 'p50_us')}\n")
        for kind, d in a["cpu_us_per_call_by_thread"].items():
            w(f"    CPU us/call by thread, {kind}: " + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + "\n")
        if a["tandem_stage_p50_us"]:
            w("    Tandem stages (median of per-round p50, us):\n")
            for k, v in a["tandem_stage_p50_us"].items():
                w(f"      {v:8.1f}  {k}\n")
    if "ingest" in result:
        g = result["ingest"]
        img = cfg["ingest_image"]
        w(f"\n(b) transition ingest: batches of {cfg['batch_records']} records x {cfg['cameras']} cameras"
          f" {img}x{img}x3 + state ({g['batch_payload_bytes'] / 1e6:.2f} MB/batch);"
          f" {cfg['ingest_rounds']} rounds x {cfg['ingest_batches']} batches;"
          f" max_in_flight {cfg['max_in_flight']}; spool fsync {'on' if cfg['spool_fsync'] else 'OFF'};"
          f" replay buffer {'cold' if cfg['cold_buffer'] else 'pre-faulted'}\n")
        for label, k in (("raw PUSH/PULL    ", "raw"), ("Tandem spool->ack", "tandem")):
            w(f"    {label}      {g[k + '_mb_s']:8.1f} MB/s   CPU {g[k + '_cpu_ms_per_mb']:6.2f} ms/MB\n")
        ok = "OK" if g["ingest_ratio"] >= TARGET_INGEST_RATIO else "MISSES"
        w(f"    ingest_ratio = {g['ingest_ratio']:.2f} (paired median {g['ingest_ratio_paired']:.2f});"
          f" target >= {TARGET_INGEST_RATIO}: {ok}\n")
        w(f"    per-round MB/s raw / tandem: {_pairs(g['rounds'], 'mb_s')}\n")
        for kind, d in g["cpu_ms_per_mb_by_thread"].items():
            w(f"    CPU ms/MB by thread, {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) + "\n")
        w(f"    (spool append, untimed above: {g['spool_append_mb_s']:.0f} MB/s; stored {g['records_stored']}"
          f" records, rejected {g['rejected']})\n")
    if "profile" in result:
        p = result["profile"]
        w("\n--- profile: stage timers (Tandem only, this process; wall time inside each call) ---\n")
        w(f"ingest: {p['ingest_timed_round_mb_s']:.0f} MB/s with timers,"
          f" wall {p['ingest_wall_us_per_batch']:.0f} us/batch\n")
        for k, v in p["ingest_stages_per_batch"].items():
            w(f"  {v['us_per_unit']:9.1f} us/batch  {k}  ({v['calls']} calls)\n")
        w(f"act: wall p50 {p['act_wall_us_per_call']:.0f} us/call with timers\n")
        for k, v in p["act_stages_per_call"].items():
            w(f"  {v['us_per_unit']:9.1f} us/call   {k}  ({v['calls']} calls)\n")
        for key in ("ingest_cprofile_server", "ingest_cprofile_client",
                    "act_cprofile_server", "act_cprofile_client"):
            if p.get(key):
                w(f"\n--- cProfile {key} (by tottime) ---\n{p[key]}")


def parse_args(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--act-iters", type=int, default=500, help="act calls per round")
    ap.add_argument("--act-warmup", type=int, default=200, help="warm-up act calls (each path)")
    ap.add_argument("--act-rounds", type=int, default=5, help="interleaved rounds (0 skips part a)")
    ap.add_argument("--act-image", type=int, default=224)
    ap.add_argument("--ingest-batches", type=int, default=24, help="batches per round")
    ap.add_argument("--ingest-rounds", type=int, default=5, help="interleaved rounds (0 skips part b)")
    ap.add_argument("--ingest-warmup-batches", type=int, default=4)
    ap.add_argument("--batch-records", type=int, default=32)
    ap.add_argument("--cameras", type=int, default=2)
    ap.add_argument("--ingest-image", type=int, default=128)
    ap.add_argument("--state-dim", type=int, default=8)
    ap.add_argument("--action-dim", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=10, help="action chunk length H of the act reply")
    ap.add_argument("--buffer-capacity", type=int, default=2048, help="replay buffer records")
    ap.add_argument("--max-in-flight", type=int, default=16, help="LearnerClient in-flight batches")
    ap.add_argument("--spool-fsync", action="store_true", help="fsync spool appends (default off)")
    ap.add_argument("--cold-buffer", action="store_true",
                    help="do not pre-fault the replay buffer's pages (measure a fresh buffer's first pass)")
    ap.add_argument("--client-in-process", action="store_true",
                    help="run the client side in a thread of this process instead of a child process")
    ap.add_argument("--profile", action="store_true", help="add stage-timer and cProfile passes")
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.batch_records < 2:
        ap.error("--batch-records must be >= 2")
    if min(args.act_iters, args.ingest_batches) < 1:
        ap.error("iteration counts must be >= 1")
    return {k: v for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = run_bench(cfg)
    s = summary(cfg, result)
    if cfg["json"]:
        sys.stdout.write(json.dumps(s) + "\n")
    else:
        print_report(cfg, result, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
