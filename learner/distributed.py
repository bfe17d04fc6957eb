"""The learner as N ranks (``launch/run_learner.sh --gpus N``): rank 0 owns the network,
every rank trains.

Rank 0 is the whole learner of :mod:`learner.app` (service, ingest, episode store, serving
copy, metrics, checkpoints); ranks 1..N-1 are :class:`Follower` s: the same networks and
algorithm (same seed; ``accelerator.prepare`` broadcasts rank 0's weights anyway), no
sockets, no data, no files but a small ``rank<k>.json`` status.

Control: rank 0 decides and broadcasts every step's verdict as one int64 pair (``CTRL_*``):
an update (followed by its data), a weights gather (ZeRO-3 publish), stop, or idle (a
heartbeat every ``distributed.heartbeat_s`` while there is nothing to train on, so that the
followers' wait is bounded by the collective timeout) or a checkpoint (``CTRL_SAVE``: every
rank writes its DeepSpeed engine state into the folder rank 0 names, rank 0 its own files,
``latest`` moves once all finished; :mod:`learner.engine_state`), or a weight sync
(``CTRL_SYNC``: rank 0 changed its weights outside an update, rejection sampling's roll-back,
and broadcasts them; DDP only). Versions, jobs and publishing stay on rank 0. On start rank 0 picks the checkpoint and broadcasts its path;
every rank loads it (and its engine state), and a resume at another N is refused.

Batch route: **rank 0 samples the global batch and scatters shares**. Rank 0's algorithm
draws exactly what one process would (``batch_size`` rows, or a whole PPO/GRPO round) through
its agent's ``update``, on the way through :class:`RootRoute`: a header (keys, dtypes, shapes as
JSON bytes in a uint8 tensor; strings as padded UTF-8 rows) is broadcast, then every tensor
is split into N equal row blocks and ``torch.distributed.scatter``-ed; rank r gets rows
[r n, (r+1) n). Off-policy and BC batches (SAC, rejection sampling) must split evenly
(``batch_size`` a multiple of N);
on-policy rounds are padded with ``mask = False`` rows. On GPUs (NCCL) the scatter runs from
rank 0's GPU; ``python -m learner.distributed [rows] [image size]`` measures a scatter's cost.

A rank that dies: the others' next collective fails (gloo/NCCL report the closed peer) or
times out after ``distributed.timeout_s``; rank 0 logs which, checkpoints and exits non-zero,
followers exit non-zero, and the launcher (torchrun / accelerate launch) ends the rest.
Actors keep their spools and reconnect when the learner is restarted (it resumes from its
checkpoint at the same N).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from learner.engine_state import all_ok, follow_save, restore_algo
from learner.rank_control import CTRL_GATHER, CTRL_SAVE, CTRL_STOP, CTRL_SYNC, CTRL_UPDATE

log = logging.getLogger("tandem.learner")

_BATCH, _STREAM = 1, 0  # CTRL_UPDATE's argument: one batch (on-policy) or a batch stream (SAC)


def cpu_offload(cfg: Any) -> bool:
    """Whether the run's DeepSpeed config (``deepspeed.config``, else config/deepspeed/zero<stage>.json)
    offloads optimizer state or parameters to the CPU, whose optimizer runs on OpenMP threads."""
    from pathlib import Path

    ds = cfg.get("deepspeed") or {}
    stage = int(ds.get("stage") or 0)
    if stage < 2:
        return False
    path = Path(ds.get("config") or Path(__file__).resolve().parents[1] / "config" / "deepspeed" / f"zero{stage}.json")
    try:
        zero = json.loads(path.read_text()).get("zero_optimization", {})
    except (OSError, ValueError):
        return False  # (run_learner.sh refuses a missing config before the learner starts)
    return any(str((zero.get(k) or {}).get("device", "none")).lower() in ("cpu", "nvme")
               for k in ("offload_optimizer", "offload_param"))


def intra_op_threads(setting: Any, gpu: bool, offload: bool = False) -> int | None:
    """``trainer.num_threads`` as torch's intra-op thread count to set, or None (torch's default).

    ``auto`` (the default): one where the learner trains on a GPU, torch's default on a CPU. A GPU
    learner's CPU work is the serving and training threads' launches and small copies; each copy
    over torch's grain size opens an OpenMP region whose team (a worker per core) spins after it,
    against the actor or simulator processes on the box and the trainer's own threads (8
    closed-loop LIBERO actors on one H200 box, OFT serving FP8 and training: 0.15 updates/s with
    torch's default of 16 threads, 0.35 with one; docs/benchmarks.md), unless DeepSpeed offloads to
    the CPU (``offload``: its CPU optimizer runs on those threads). ``0``: torch's default; a
    positive number: that many."""
    if setting is None or str(setting) == "auto":
        return 1 if gpu and not offload else None
    try:
        n = int(setting)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(setting, bool):
        raise ValueError(f"trainer.num_threads must be auto, 0 (torch's default) or a thread count, got {setting!r}")
    return n or None


def make_accelerator(cpu: bool, timeout_s: float = 300.0):
    """The learner's Accelerator: DDP looks for unused parameters (the algorithms' phase
    forwards, :func:`agents.parallel.accelerator_kwargs`), collectives time out after ``timeout_s``,
    and optimizer steps with a non-finite loss or gradient are skipped and counted
    (:class:`learner.finite_guard.GuardedAccelerator`)."""
    from accelerate.utils import InitProcessGroupKwargs

    from agents.parallel import accelerator_kwargs
    from learner.finite_guard import GuardedAccelerator

    return GuardedAccelerator(cpu=cpu, kwargs_handlers=accelerator_kwargs() + [
        InitProcessGroupKwargs(timeout=timedelta(seconds=float(timeout_s)))])


class RankError(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


class Ranks:
    """Rank 0's broadcasts and scatters, and the followers' receiving side."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.rank = int(accelerator.process_index)
        self.world = int(accelerator.num_processes)
        # gloo moves CPU tensors, NCCL CUDA ones
        self.device = (accelerator.device if dist.is_initialized() and dist.get_backend() == "nccl"
                       else torch.device("cpu"))
        self.sent = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _coll(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (RuntimeError, dist.DistError) as exc:
            raise RankError(f"rank {self.rank}: a collective with the other ranks failed "
                            f"(a rank died or stopped answering): {exc}") from exc

    # -- control -----------------------------------------------------------------------------
    def send(self, code: int, arg: int = 0) -> None:
        self._coll(dist.broadcast, torch.tensor([code, arg], dtype=torch.int64, device=self.device), src=0)
        self.sent += 1

    def recv(self) -> tuple[int, int]:
        t = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._coll(dist.broadcast, t, src=0)
        return int(t[0]), int(t[1])

    # -- batches -----------------------------------------------------------------------------
    def _bytes(self, data: bytes | None) -> bytes:
        n = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=self.device)
        self._coll(dist.broadcast, n, src=0)
        if int(n) == 0:  # nothing to send (an empty text): torch.frombuffer refuses b""
            return b""
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data is not None
               else torch.empty(int(n), dtype=torch.uint8, device=self.device))
        self._coll(dist.broadcast, buf, src=0)
        return bytes(buf.cpu().numpy())

    def share_text(self, text: str | None) -> str:
        """Rank 0 passes ``text``, the others None: every rank returns rank 0's text."""
        if self.world == 1:
            return text or ""
        return self._bytes(None if text is None else text.encode()).decode()

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when every rank passed True (a barrier)."""

        return self._coll(all_ok, self.device, ok) if self.world > 1 else ok

    def scatter_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: split ``batch`` (tensors and string lists, all [N, ...]) into equal row
        blocks, send block r to rank r, return block 0 (see the module docstring)."""
        batch = _even(batch, self.world)
        rows = next(len(v) for v in batch.values())
        head, tensors = [], []
        for k, v in batch.items():
            t, kind = _as_tensor(v)
            head.append([k, kind, str(t.dtype).removeprefix("torch."), list(t.shape[1:])])
            tensors.append(t)
        self._bytes(json.dumps({"rows": rows, "keys": head}).encode())
        out = {}
        for (k, kind, _, _), t in zip(head, tensors):
            parts = [p.contiguous().to(self.device) for p in t.chunk(self.world)]
            mine = torch.empty_like(parts[0])
            self._coll(dist.scatter, mine, scatter_list=parts, src=0)
            out[k] = _from_tensor(mine.cpu() if self.device.type == "cpu" else mine, kind)
        return out

    def receive_batch(self) -> dict[str, Any]:
        """Ranks > 0: this rank's block of the batch rank 0 scatters."""
        head = json.loads(self._bytes(None).decode())
        n = head["rows"] // self.world
        out = {}
        for k, kind, dtype, shape in head["keys"]:
            mine = torch.empty((n, *shape), dtype=getattr(torch, dtype), device=self.device)
            self._coll(dist.scatter, mine, scatter_list=None, src=0)
            out[k] = _from_tensor(mine, kind)
        return out


def _even(batch: dict[str, Any], world: int) -> dict[str, Any]:
    rows = next(len(v) for v in batch.values())
    pad = -rows % world
    if not pad:
        return batch
    if "mask" not in batch:
        raise ValueError(f"a batch of {rows} rows does not split into {world} equal rank shares: "
                         f"make the batch size a multiple of the number of ranks ({world})")
    idx = torch.cat([torch.arange(rows), torch.full((pad,), rows - 1)])
    out = {k: (v.index_select(0, idx) if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()])
           for k, v in batch.items()}
    out["mask"][rows:] = False  # the padding rows never enter a loss
    return out


def _as_tensor(v: Any) -> tuple[torch.Tensor, str]:
    if isinstance(v, torch.Tensor):
        return (v.to(torch.uint8), "bool") if v.dtype == torch.bool else (v, "tensor")
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        raw = [s.encode() for s in v]
        width = max((len(r) for r in raw), default=0) + 1  # a trailing 0 ends every string
        t = torch.zeros((len(raw), width), dtype=torch.uint8)
        for i, r in enumerate(raw):
            if r:
                t[i, :len(r)] = torch.frombuffer(bytearray(r), dtype=torch.uint8)
        return t, "str"
    raise TypeError(f"cannot send a batch value of type {type(v).__name__} to the other ranks")


def _from_tensor(t: torch.Tensor, kind: str) -> Any:
    if kind == "bool":
        return t.bool()
    if kind == "str":
        return [bytes(r.cpu().numpy()).split(b"\0", 1)[0].decode() for r in t]
    return t


class _ScatterStream:
    """Rank 0's batch stream for an off-policy update: each ``next`` draws a global batch
    from the algorithm's own stream and scatters it."""

    def __init__(self, batches: Iterator, ranks: Ranks):
        self.batches, self.ranks = batches, ranks

    def __iter__(self):
        return self

    def __next__(self):
        return self.ranks.scatter_batch(next(self.batches))


class _ReceiveStream:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def __iter__(self):
        return self

    def __next__(self):
        return self.ranks.receive_batch()


class RootRoute:
    """Rank 0's route of every update's data (:attr:`agents.core.AlgoLearner.route`): announces
    the update to the followers and scatters its data (a batch, or each batch of a stream);
    the agent's own update then runs on block 0. :meth:`sync_weights` hands rank 0's
    trainable weights to every rank (after an algorithm changed them outside an update)."""

    def __init__(self, ranks: Ranks):
        self._ranks = ranks

    def __call__(self, data):
        if isinstance(data, dict):
            self._ranks.send(CTRL_UPDATE, _BATCH)
            return self._ranks.scatter_batch(data)
        self._ranks.send(CTRL_UPDATE, _STREAM)
        return _ScatterStream(data, self._ranks)

    def sync_weights(self, policy: Any, *, reset_optimizer: bool = False) -> None:
        """Every rank's trainable weights become rank 0's (the followers reset their
        optimizer too when ``reset_optimizer``, as rank 0 did)."""
        self._ranks.send(CTRL_SYNC, int(bool(reset_optimizer)))
        broadcast_trainable(policy, self._ranks)


def broadcast_trainable(policy: Any, ranks: Ranks) -> None:
    """Rank 0's trainable parameters into every rank's (in place, in parameters() order;
    every rank calls it together). Replicated weights only (DDP): a DeepSpeed engine keeps its
    own fp32 copy, which the algorithms that sync refuse."""
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                ranks._coll(dist.broadcast, p.data, src=0)


def gathered_trainable(policy: Any, accelerator: Any) -> dict[str, torch.Tensor]:
    """The policy's trainable weights, complete on every rank that calls it. Under ZeRO-3
    each rank holds a shard: every rank must call this together (rank 0 sends CTRL_GATHER
    first); the parameters are gathered with DeepSpeed's ``GatheredParameters`` for the
    read. Elsewhere the weights are whole already."""
    from agents.parallel import is_zero3, zero3_gathered

    if not is_zero3(accelerator):
        return policy.trainable_state_dict()
    with zero3_gathered([p for p in policy.parameters() if p.requires_grad], accelerator):
        return {k: v.detach().clone().cpu() for k, v in policy.trainable_state_dict().items()}


def needs_gather(accelerator: Any) -> bool:
    from agents.parallel import is_zero3

    return is_zero3(accelerator)


def follow(algo: Any, ranks: Ranks, status_path=None, every_s: float = 1.0) -> int:
    """A follower's loop: run what rank 0 announces until it says stop; returns the number
    of updates. Writes ``{"rank", "updates"}`` to ``status_path`` about every ``every_s``."""
    agent, updates, last = algo.agent, 0, 0.0

    def write():
        if status_path is not None:
            tmp = status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": ranks.rank, "updates": updates, "time": time.time()}))
            tmp.replace(status_path)

    while True:
        code, arg = ranks.recv()
        if code == CTRL_STOP:
            break
        if code == CTRL_UPDATE:
            agent.update(ranks.receive_batch() if arg == _BATCH else _ReceiveStream(ranks))
            updates += 1
            algo.updates += 1
        elif code == CTRL_GATHER:
            gathered_trainable(algo.policy, ranks.accelerator)
        elif code == CTRL_SAVE:
            follow_save(ranks, algo)
        elif code == CTRL_SYNC:
            broadcast_trainable(algo.policy, ranks)
            if arg:
                algo.agent.reset_optimizer()
        if time.monotonic() - last >= every_s:
            write()
            last = time.monotonic()
    write()
    return updates


class _NoData:
    """What a follower's builder gets for ``data``: the algorithm is built, never fed (no
    training data: ``train`` False, so no jobs and no data checks)."""

    sink = store = sampler = queue = demo = None
    train = False


def check_world(cfg: Any, world: int, algo_name: str) -> None:
    """Start-up checks of an N-rank learner, with messages naming what to change."""
    gpus, nodes = int(cfg.get("gpus", 1) or 1), int(cfg.get("nodes", 1) or 1)
    want = gpus * nodes
    if world != want:
        how = f"--gpus {gpus}" + (f" --nodes {nodes} on each of {nodes} hosts" if nodes > 1 else "")
        raise ValueError(f"gpus={gpus} x nodes={nodes} but the learner runs as {world} processes: "
                         f"start it with launch/run_learner.sh {how}")
    if world > 1 and cfg.mode != "train":
        raise ValueError(f"mode={cfg.mode} does not train: run it with gpus=1")
    bs = int(cfg.algo.get("batch_size", 0) or 0)
    even = algo_name == "sac" or algo_name.startswith("sac_") or algo_name == "rejection_sampling"
    if world > 1 and even and bs % world:
        raise ValueError(f"algo.batch_size={bs} must be a multiple of gpus={world} (every rank "
                         "trains on an equal share of each batch)")


def check_shared_run_dir(ranks: "Ranks", run_dir: Any) -> None:
    """Every rank must see the run folder rank 0 writes (checkpoints are written by all ranks
    into the folder rank 0 names, and loaded by all from the path rank 0 picks): rank 0 leaves
    a marker there, every rank looks for it; on hosts that do not share that folder, every rank
    stops with the same message."""
    import secrets
    from pathlib import Path

    if ranks.world == 1:
        return
    run_dir = Path(run_dir)
    token = ranks.share_text(secrets.token_hex(8) if ranks.rank == 0 else None)
    marker = run_dir / f".rank0-{token}"
    if ranks.rank == 0:
        marker.write_text("written by rank 0")
    ranks.all_ok(True)  # the marker exists before anyone looks
    ok = ranks.all_ok(marker.exists())
    if ranks.rank == 0:
        marker.unlink(missing_ok=True)
    if not ok:
        raise ValueError(f"run_dir {run_dir} is not the same folder on every learner rank: on several "
                         "hosts put run_dir on a filesystem every node shares (NFS, say), at the same path")


class Follower:
    """Rank k > 0 of an N-rank learner (module docstring): builds the algorithm like rank 0,
    resumes from the same checkpoint, then runs :func:`follow`."""

    def __init__(self, cfg: Any):
        from pathlib import Path

        from agents import registry
        from agents.base import extras_ranges
        from envs.registry import env_spec
        from learner.checkpoint import load_checkpoint

        torch.manual_seed(cfg.seed)
        cpu = str(cfg.device) == "cpu" or not torch.cuda.is_available()
        threads = intra_op_threads(cfg.trainer.get("num_threads"), gpu=not cpu, offload=cpu_offload(cfg))
        if threads:
            torch.set_num_threads(threads)
        self.accelerator = make_accelerator(cpu, cfg.distributed.timeout_s)
        self.ranks = Ranks(self.accelerator)
        check_world(cfg, self.ranks.world, cfg.algo.name)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_shared_run_dir(self.ranks, self.run_dir)
        builder = registry.build_builder(cfg.algo)
        env = env_spec(cfg.env)
        policy = registry.build_trained_policy(builder, cfg.policy, env)
        spec = env.with_extras(policy.extras_spec(), extras_ranges(policy))
        networks = builder.make_networks(spec, policy, self.accelerator.device)
        self.algo = builder.make_learner(networks, _NoData(), self.accelerator, env_steps=lambda: 0)
        name = self.ranks.share_text(None)  # rank 0's pick (learner.checkpointing.Checkpointer.restore)
        if name:
            path = Path(name)
            restore_algo(self.algo, load_checkpoint(path), path, self.ranks.world, train=True)
            log.info("rank %d resumed from %s", self.ranks.rank, path)

    def run(self) -> int:
        import signal

        # Ctrl-C / SIGTERM reach every rank of a launch: the followers leave the stop to rank
        # 0, which writes the last checkpoint with them and then sends CTRL_STOP
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        try:
            n = follow(self.algo, self.ranks, self.run_dir / f"rank{self.ranks.rank}.json")
        except RankError as exc:
            log.error("%s; rank %d stops", exc, self.ranks.rank)
            raise SystemExit(3) from exc
        log.info("rank %d: %d updates, stopped by rank 0", self.ranks.rank, n)
        return n


def _bench_worker(rank: int, world: int, port: int, rows: int, image: int) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ranks = Ranks(make_accelerator(cpu=True))
    g = torch.Generator().manual_seed(0)
    batch = {"observation.state": torch.randn(rows, 17, generator=g),
             "next.observation.state": torch.randn(rows, 17, generator=g),
             "action": torch.rand(rows, 6, generator=g), "reward": torch.randn(rows, generator=g),
             "terminated": torch.zeros(rows, dtype=torch.bool), "truncated": torch.zeros(rows, dtype=torch.bool),
             "intervened": torch.zeros(rows, dtype=torch.bool),
             "policy_version": torch.zeros(rows, dtype=torch.int64), "task": ["reach the cube"] * rows}
    if image:
        for k in ("observation.images.front", "next.observation.images.front"):
            batch[k] = torch.randint(0, 256, (rows, image, image, 3), dtype=torch.uint8, generator=g)
    reps, times = 30, []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        ranks.scatter_batch(batch) if rank == 0 else ranks.receive_batch()
        times.append(time.perf_counter() - t)
    if rank == 0:
        times.sort()
        print(f"{world} ranks, {rows} rows{f', {image}x{image} images' if image else ''}: scatter "
              f"median {1e3 * times[reps // 2]:.2f} ms, p90 {1e3 * times[int(reps * 0.9)]:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":  # python -m learner.distributed [rows] [image size]: the batch route's cost
    import socket
    import sys

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    rows_, image_ = (int(sys.argv[1]) if len(sys.argv) > 1 else 256), (int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    mp.start_processes(_bench_worker, args=(2, free, rows_, image_), nprocs=2, start_method="spawn")
