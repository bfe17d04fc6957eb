"""The wire fuzzer against a live learner with a real actor attached (``python -m
tools.bench.fuzz_live --minutes 10 --out DIR``).

It starts ``python -m learner`` and ``python -m actor`` (point_reach, SAC, MLP, a LeRobot
dataset: durable acks; a replay ring of 5,000 records, full within the first minute, so that the
learner's RSS is flat unless something leaks) on free loopback ports, waits until the actor acts, then runs in turn,
until the time is up: the property-based message fuzzer of :mod:`tools.bench.fuzz_wire` (a round of
hypothesis examples, each on a fresh connection after a real handshake) and every attack class
of :mod:`tools.bench.fuzz_attacks` (routing ids, float extremes, id edges, huge frames and frame
counts, malformed shapes). Every 5 s it samples the learner's and the wire gate's RSS, whether
the learner and the actor are alive, and the records the learner received from the actor.

The verdict (printed, and ``DIR/fuzz_live.json``): duration, messages per generator, learner
RSS at start / end / most, the gate's restarts and exits, processes that died, the actor's
records received during the run, and the learner's internal errors (0: every message was
answered by a named check). Exit status 0 when the learner and actor lived throughout, the
actor kept acting and the learner's memory stayed within ``--rss-slack-mb`` of its start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from data.core.codec import decode, encode
from data.core.spec import EnvSpec
from tools.bench import fuzz_attacks as A

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, StopIteration):
        return 0


def _gate_pid(parent: int) -> int | None:
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in kids:
            try:
                if b"data.core.gate_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except OSError:
                continue
    return None


class RemoteTarget:
    """:class:`tools.bench.fuzz_wire.FuzzTarget`'s check, over TCP against a learner process."""

    def __init__(self, ctx: zmq.Context, port: int, config_hash: str, timeout_s: float = 15.0):
        self.ctx, self.port, self.hash = ctx, port, config_hash
        self.timeout_ms = int(timeout_s * 1000)
        self.sent = 0
        self.replies: dict[str, int] = {}
        self._n = 0

    def _recv(self, s: zmq.Socket):
        assert s.poll(self.timeout_ms), "the learner did not answer"
        return decode(s.recv_multipart())

    def check(self, fz) -> None:
        self._n += 1
        actor_id = f"fzl-{os.getpid()}-{self._n}"
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        try:
            if fz.handshake:
                s.send_multipart([msgpack.packb({
                    "v": 1, "type": "hello", "actor_id": actor_id, "config_hash": self.hash,
                    "resend_from": fz.resend_from, "arrays": []}, use_bin_type=True)])
                self._count(self._recv(s))
            for one in [fz, *fz.more]:
                s.send_multipart(one.frames(actor_id))
                self.sent += 1
            s.send_multipart(encode("ping", {"t": -1.0}))
            while True:
                r = self._recv(s)
                self._count(r)
                if (r.type == "pong" and r["t"] == -1.0) or (
                        r.type == "error" and r["code"] == "handshake_required" and "'ping'" in r["message"]):
                    break
        finally:
            s.close(0)

    def _count(self, r) -> None:
        key = r.type if r.type not in ("error", "batch_rejected") else f"{r.type}:{r['code']}"
        self.replies[key] = self.replies.get(key, 0) + 1


def run_live(out: Path, minutes: float, *, env: str = "point_reach", rss_slack_mb: float = 200.0,
             max_message_mb: int = 64, round_examples: int = 100) -> dict:
    from hypothesis import HealthCheck, given, settings

    from tools.bench.fuzz_wire import messages

    out.mkdir(parents=True, exist_ok=True)
    port, pub = _free_port(), _free_port()
    common = [f"env={env}", f"run_dir={out / 'run'}", f"transport.port={port}",
              f"transport.pub_port={pub}", f"transport.max_message_mb={max_message_mb}",
              "transport.timeout_s=1.0", "transport.heartbeat_s=0.5"]
    procs = {}

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = open(out / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=ENV, stdout=log,
                             stderr=subprocess.STDOUT)
        procs[name] = p
        return p

    learner = start("learner", ["learner", *common, "logging.wandb=disabled", "logging.every_s=1",
                                "buffer.video=false", "buffer.capacity=5000", "trainer.num_threads=1",
                                "algo.learning_starts=200"])
    status_path = out / "run" / "status.json"

    def status() -> dict:
        try:
            return json.loads(status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait(cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            for name, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode} while waiting for {what}")
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}")

    ctx = zmq.Context()
    res: dict = {"env": env, "minutes": minutes}
    try:
        wait(lambda: "config hash" in (out / "learner.log").read_text(), 180, "the learner")
        chash = re.search(r"config hash (\w+)", (out / "learner.log").read_text()).group(1)
        actor = start("actor", ["actor", *common, "actor_id=a0", "spool.fsync=false", "log_every_s=5"])
        wait(lambda: status().get("received", {}).get("a0", -1) > 100, 180, "the actor to act")
        s = A._dealer(ctx, port)
        s.send_multipart(encode("hello", {"actor_id": "fz-probe", "config_hash": chash, "resend_from": 0}))
        assert s.poll(10000)
        welcome = decode(s.recv_multipart())
        s.close(0)
        spec = EnvSpec.from_dict(welcome["spec"])
        act_port = int(welcome["act_port"]) or port
        gate0 = _gate_pid(learner.pid)
        res.update(learner_rss_start_mb=_rss(learner.pid) / 2**20,
                   gate_rss_start_mb=_rss(gate0) / 2**20 if gate0 else None)
        target = RemoteTarget(ctx, port, chash)
        limit = max_message_mb << 20
        counts = {k: 0 for k in ("hypothesis", "routing_ids", "float_extremes", "id_edges",
                                 "huge_frames", "bad_shapes")}
        gens = [
            ("routing_ids", lambda: A.routing_ids(ctx, [port, act_port], span=64, randoms=64)),
            ("float_extremes", lambda: A.float_extremes(ctx, port, spec, chash)),
            ("id_edges", lambda: A.id_edges(ctx, port, spec, chash)),
            ("huge_frames", lambda: A.huge_frames(ctx, port, limit=limit)),
            ("bad_shapes", lambda: A.bad_shapes(ctx, port, spec, chash)),
        ]

        @settings(max_examples=round_examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(messages())
        def hypothesis_round(fz):
            target.check(fz)

        samples, t0 = [], time.monotonic()
        received0 = status().get("received", {}).get("a0", -1)
        deadline, last_sample, i = t0 + minutes * 60, 0.0, 0
        errors: list[str] = []
        while time.monotonic() < deadline:
            if i % (len(gens) + 1) == len(gens):
                before = target.sent
                try:
                    hypothesis_round()
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    errors.append(f"hypothesis: {type(exc).__name__}: {str(exc)[:300]}")
                counts["hypothesis"] += target.sent - before
            else:
                name, gen = gens[i % (len(gens) + 1)]
                try:
                    counts[name] += gen()
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            i += 1
            now = time.monotonic()
            if now - last_sample >= 5.0:
                last_sample = now
                gate = _gate_pid(learner.pid)
                st = status()
                samples.append({"t": round(now - t0, 1), "learner_rss_mb": _rss(learner.pid) / 2**20,
                                "gate_rss_mb": _rss(gate) / 2**20 if gate else None,
                                "received_a0": st.get("received", {}).get("a0", -1),
                                "learner_alive": learner.poll() is None,
                                "actor_alive": actor.poll() is None})
                if learner.poll() is not None or actor.poll() is not None:
                    break
        st = status()
        rss = [x["learner_rss_mb"] for x in samples if x["learner_rss_mb"]]
        res.update(
            seconds=round(time.monotonic() - t0, 1), messages=counts, total=sum(counts.values()),
            replies=target.replies, learner_rss_end_mb=_rss(learner.pid) / 2**20,
            learner_rss_max_mb=max(rss) if rss else None,
            gate_rss_max_mb=max([x["gate_rss_mb"] or 0 for x in samples], default=None),
            learner_alive=learner.poll() is None, actor_alive=actor.poll() is None,
            learner_exit=learner.poll(), actor_exit=actor.poll(),
            actor_records_during=st.get("received", {}).get("a0", -1) - received0,
            wire_gate=st.get("wire_gate"), internal_errors=st.get("internal_errors"),
            rejected_by_code=st.get("rejected_by_code"), generator_errors=errors[:20],
            samples=samples)
        res["ok"] = bool(res["learner_alive"] and res["actor_alive"] and res["actor_records_during"] > 0
                         and res["learner_rss_end_mb"] - res["learner_rss_start_mb"] <= rss_slack_mb)
        return res
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        ctx.destroy(0)
        (out / "fuzz_live.json").write_text(json.dumps(res, indent=1, default=str))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Fuzz a learner process with a real actor attached.")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long")
    ap.add_argument("--out", default="runs/fuzz_live", help="logs, run_dir, fuzz_live.json")
    args = ap.parse_args()
    res = run_live(Path(args.out), args.minutes)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1, default=str))
    raise SystemExit(0 if res.get("ok") else 1)


if __name__ == "__main__":
    main()
