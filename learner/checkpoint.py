"""Atomic checkpoints without pickle: tensors in safetensors, everything else in JSON.

A nested state (dicts, lists, tensors, numbers, strings, None) is flattened: every tensor
goes into ``tensors.safetensors`` under its path (``agent/critic_opt/state/3/exp_avg``) and
the rest of the tree goes into ``state.json`` with a ``{"__tensor__": path}`` marker where a
tensor was. A checkpoint is written into a temporary folder, fsynced and renamed into place
(``step_00001000``), then ``latest`` (a small text file) is replaced atomically, so a
learner killed mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from data.fsutil import atomic_write, fsync_path

TENSORS = "tensors.safetensors"
STATE = "state.json"
LATEST = "latest"


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = str(k)
            out[key] = _flatten(v, f"{path}/{key}" if path else key, tensors)
        # int keys (optimizer state) must survive the JSON round trip
        if obj and all(isinstance(k, int) for k in obj):
            out = {"__intkeys__": out}
        return out
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path!r}")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__intkeys__"}:
            return {int(k): _unflatten(v, tensors) for k, v in obj["__intkeys__"].items()}
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj




def save_checkpoint(root: str | Path, step: int, state: dict, *, keep: int = 2) -> Path:
    """Write ``state`` atomically as ``root/step_<step>``; keep the newest ``keep``."""
    tmp = begin_checkpoint(root, step)
    write_state(tmp, state)
    return commit_checkpoint(root, tmp, step, keep=keep)


def begin_checkpoint(root: str | Path, step: int) -> Path:
    """An empty temporary folder for the checkpoint of ``step`` (``.tmp_step_<step>_<pid>``):
    never loaded until :func:`commit_checkpoint` renames it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step:010d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def write_state(folder: str | Path, state: dict) -> None:
    """``state`` as ``tensors.safetensors`` + ``state.json`` in ``folder``, fsynced."""
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(state, "", tensors)
    # safetensors refuses tensors that share memory; clone those.
    seen: set[int] = set()
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen:
            tensors[k] = t.clone()
        seen.add(ptr)
    save_file(tensors, str(folder / TENSORS))
    with open(folder / STATE, "w") as f:
        json.dump(tree, f)
        f.flush()
        os.fsync(f.fileno())
    with open(folder / TENSORS, "rb+") as f:
        os.fsync(f.fileno())


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under ``folder`` (files other processes wrote: the ranks'
    DeepSpeed engine state), then ``folder`` itself."""
    for dirpath, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)


def commit_checkpoint(root: str | Path, tmp: str | Path, step: int, *, keep: int = 2) -> Path:
    """Rename the written ``tmp`` folder to ``root/step_<step>``, then move ``latest`` to it
    (atomically); keep the newest ``keep`` checkpoints and clear temporary folders of killed
    processes."""
    root, tmp = Path(root), Path(tmp)
    name = f"step_{step:010d}"
    final = root / name
    fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write(root / LATEST, name.encode())
    fsync_path(root)
    ckpts = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):  # half-written by a killed process: never loaded
        if not stale.name.endswith(f"_{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    marker = root / LATEST
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    return path if (path / STATE).exists() and (path / TENSORS).exists() else None


def checkpoint_age_s(path: str | Path) -> float:
    """Seconds since the checkpoint at ``path`` was written (its state file's mtime)."""
    import time

    return max(0.0, time.time() - (Path(path) / STATE).stat().st_mtime)


def format_age(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``, ``2d04h``: how old a checkpoint is, for the log."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> dict:
    path = Path(path)
    if not (path / STATE).exists() or not (path / TENSORS).exists():
        raise FileNotFoundError(f"{path} is not a Tandem checkpoint (needs {STATE} and {TENSORS})")
    tensors = load_file(str(path / TENSORS), device=str(device))
    with open(path / STATE) as f:
        tree = json.load(f)
    return _unflatten(tree, tensors)
