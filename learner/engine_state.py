"""Checkpoints of an N-rank learner: the DeepSpeed engines' own state next to rank 0's files.

Under DeepSpeed (ZeRO-2/3) each rank holds a shard of the optimizer state (ZeRO-3: of the
weights too), so rank 0 alone cannot write a complete checkpoint. A checkpoint of an N-rank
learner is therefore written by every rank into one folder (one host: ``launch/run_learner.sh``
starts all ranks on one machine, so they share the file system):

1. rank 0 decides (it owns the update counter and the clock), makes the temporary folder
   ``.tmp_step_<step>_<pid>`` (:func:`learner.checkpoint.begin_checkpoint`), broadcasts
   ``CTRL_SAVE`` and the folder's path;
2. every rank calls its algorithm's ``agent.state_dict()`` together (under ZeRO-3 it gathers
   the weights: a collective), rank 0 keeps the result;
3. every rank calls each DeepSpeed engine's ``save_checkpoint`` into ``<tmp>/engine/model<i>``
   (weights, the rank's optimizer partition, step counters; frozen parameters left out:
   the backbone is rebuilt from its pretrained files);
4. rank 0 writes its own non-engine state (counters, ingest/replay positions, the gathered
   trainable weights, and ``ranks`` = {world, engines, zero_stage}) as ``state.json`` +
   ``tensors.safetensors``, as a single-process learner does;
5. the ranks agree that all of them finished (an all-reduce of a success flag: the barrier);
   only then does rank 0 fsync the folder's files, rename it to ``step_<step>`` and move
   ``latest``. A rank killed mid-write leaves ``latest`` on the previous checkpoint.

On start, rank 0 picks the checkpoint (``latest``) and broadcasts its path; every rank loads
the same ``state.json`` + tensors into its algorithm, then each engine's state from
``engine/`` (:func:`restore_algo`). A checkpoint records the number of ranks it was written
by; a training resume at another N is refused with both numbers (DeepSpeed's optimizer
partitions only load at the same N; the batch shares change with N). Evaluation
(``mode=eval``) at any N reads only the weights in the safetensors.

Without DeepSpeed (one process, or DDP) there are no engines and rank 0's files hold the
whole state (every DDP rank has identical weights and optimizer state), as before.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from learner.checkpoint import begin_checkpoint, commit_checkpoint, fsync_tree, write_state
from learner.rank_control import CTRL_SAVE

log = logging.getLogger("tandem.learner")

ENGINE = "engine"


def engines_of(algo: Any) -> list:
    """The DeepSpeed engines the algorithm's agent trains (``agent.parallel_engines()``, in a
    fixed order; empty without DeepSpeed)."""
    fn = getattr(algo.agent, "parallel_engines", None)
    return list(fn()) if callable(fn) else []


def ranks_meta(world: int, engines: list) -> dict:
    stage = int(engines[0].zero_optimization_stage()) if engines else 0
    return {"world": int(world), "engines": len(engines), "zero_stage": stage}


def check_resume(meta: dict | None, world: int, engines: list, path: Path) -> None:
    """Refuse to resume training from ``path`` at another number of ranks or another engine
    layout, naming both. Checkpoints written before this was recorded pass."""
    if not meta:
        return
    if int(meta["world"]) != int(world):
        raise ValueError(
            f"checkpoint {path} was written by a learner of {meta['world']} rank(s) (--gpus "
            f"{meta['world']}); this learner runs {world}: resume it with --gpus {meta['world']} "
            f"({'its optimizer state is split per rank' if int(meta.get('engines', 0)) else 'a resume keeps the number of ranks'}), "
            "or start a new run_dir / pass resume=never")
    have = ranks_meta(world, engines)
    if int(meta["engines"]) != have["engines"] or int(meta["zero_stage"]) != have["zero_stage"]:
        def say(m):
            return f"DeepSpeed ZeRO-{m['zero_stage']}" if m["engines"] else "no DeepSpeed"
        raise ValueError(f"checkpoint {path} was written with {say(meta)}; this learner runs with "
                         f"{say(have)}: resume it with the same deepspeed.stage, or start a new run_dir")


def save_engines(engines: list, folder: Path) -> None:
    """Every rank, together: each engine's state into ``folder/model<i>``."""
    for i, engine in enumerate(engines):
        engine.save_checkpoint(str(folder), tag=f"model{i}", save_latest=False,
                               exclude_frozen_parameters=True)


def load_engines(engines: list, folder: Path) -> None:
    """Every rank, together: each engine's state back from ``folder/model<i>``.

    DeepSpeed reads its files with ``torch.load`` (pickle). These are this learner's own local
    files, written by :func:`save_engines` on this host; nothing that arrives over the network
    is ever read this way (the wire and the weight broadcasts stay safetensors/msgpack)."""
    for i, engine in enumerate(engines):
        path, _ = engine.load_checkpoint(str(folder), tag=f"model{i}", load_module_strict=False,
                                         load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{folder}/model{i}: no DeepSpeed engine state to resume from")


def restore_algo(algo: Any, state: dict, path: Path, world: int, *, train: bool) -> None:
    """Load a checkpoint's ``state`` into ``algo`` on this rank (every rank calls it, same
    file): the N check, the algorithm's own state, then the engines' state."""
    engines = engines_of(algo)
    meta = state.get("ranks")
    if train:
        check_resume(meta, world, engines, path)
    algo.load_state_dict(state["algo"])
    if engines and meta and int(meta.get("engines", 0)):
        load_engines(engines, Path(path) / ENGINE)


def _attempt(what: str, fn: Callable[[], Any]) -> bool:
    try:
        fn()
        return True
    except Exception as exc:  # noqa: BLE001 - reported to the other ranks, latest stays put
        log.error("checkpoint: %s failed: %s: %s", what, type(exc).__name__, exc)
        return False


def save_ranked(ranks: Any, root: Path, step: int, state_fn: Callable[[], dict], engines: list,
                *, keep: int) -> Path | None:
    """Rank 0: the N-rank checkpoint (module docstring). ``state_fn()`` builds rank 0's state
    (it calls ``algo.state_dict()``, which the other ranks mirror). Returns the checkpoint, or
    None when a rank failed to write its part (``latest`` not moved)."""
    tmp = begin_checkpoint(root, step)
    if ranks.world > 1:
        ranks.send(CTRL_SAVE, step)
        ranks.share_text(str(tmp.resolve()))
    state = state_fn()
    ok = _attempt("the engine state", lambda: save_engines(engines, tmp / ENGINE)) if engines else True
    ok = _attempt("rank 0's state", lambda: write_state(tmp, state)) and ok
    if ranks.world > 1:
        ok = ranks.all_ok(ok)  # every rank finished writing: only now may `latest` move
    if not ok:
        shutil.rmtree(tmp, ignore_errors=True)
        log.error("checkpoint of update %d not written (a rank failed); %s stays the latest", step,
                  (root / "latest").read_text().strip() if (root / "latest").exists() else "nothing")
        return None
    fsync_tree(tmp)
    return commit_checkpoint(root, tmp, step, keep=keep)


def follow_save(ranks: Any, algo: Any) -> bool:
    """Ranks > 0 on ``CTRL_SAVE``: mirror rank 0's ``agent.state_dict()`` (its collectives),
    write this rank's engine state into the folder rank 0 names, report success."""
    tmp = Path(ranks.share_text(None))
    algo.agent.state_dict()
    engines = engines_of(algo)
    ok = _attempt(f"rank {ranks.rank}'s engine state",
                  lambda: save_engines(engines, tmp / ENGINE)) if engines else True
    return ranks.all_ok(ok)


def all_ok(device: torch.device, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag))
