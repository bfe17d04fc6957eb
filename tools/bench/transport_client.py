"""The transport bench's client (actor) side: a LearnerClient per Tandem stack and the raw
REQ / PUSH sockets, run in a spawned child process (or a thread with ``--client-in-process``)
and driven over a pipe by :class:`WorkerHandle`."""

from __future__ import annotations

import cProfile
import multiprocessing as mp
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import zmq

from actor.client import LearnerClient
from actor.spool import Spool
from data.core.codec import encode_to_bytes, frames_from_bytes
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE
from tools.bench.common import HOST, perf, quiet_logging
from tools.bench.procstat import stats_text, thread_cpu
from tools.bench.transport_data import (
    ACT_ACTOR, INGEST_ACTOR, act_observation, act_spec, frames_nbytes, ingest_images, ingest_spec,
    make_batch, spec_hash,
)


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
    quiet_logging()
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
