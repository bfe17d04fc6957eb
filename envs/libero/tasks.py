"""LIBERO's suites, task lists, time limits and fixed initial states, read from the installed
``libero`` package's files without importing it (no simulator, no torch).

``list_tasks(suite)`` gives the tasks in LIBERO's default order (task order index 0);
``load_init_states(file)`` reads a task's ``.pruned_init`` file with a restricted unpickler
(numpy arrays only), so neither torch nor ``libero.libero.benchmark`` is loaded.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

#: per-suite time limits in policy steps (OpenVLA-OFT's LIBERO evaluation)
SUITE_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITES = tuple(SUITE_MAX_STEPS)


def check_suite(suite: str | None) -> str:
    if suite not in SUITE_MAX_STEPS:
        raise ValueError(f"unknown LIBERO suite {suite!r}; one of {', '.join(SUITES)}")
    return str(suite)


def libero_pkg_dir() -> Path:
    """``<site-packages>/libero/libero`` found without running ``libero.libero.__init__``."""
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the LIBERO package is not installed (PyPI: hf-libero)")
    return Path(list(spec.submodule_search_locations)[0]) / "libero"


def _task_map() -> dict[str, list[str]]:
    """LIBERO's suite -> task-name map, loaded from its file without importing the package."""
    path = libero_pkg_dir() / "benchmark" / "libero_suite_task_map.py"
    spec = importlib.util.spec_from_file_location("_tandem_libero_task_map", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod.libero_task_map


def _language_from_name(name: str) -> str:
    """LIBERO's ``grab_language_from_filename`` (benchmark/__init__.py), minus the suffix."""
    if name[0].isupper():  # LIBERO-100 names start with the scene, e.g. KITCHEN_SCENE10_...
        start = name.find("SCENE") + (8 if "SCENE10" in name else 7)
        return " ".join(name[start:].split("_"))
    return " ".join(name.split("_"))


@dataclass(frozen=True)
class LiberoTask:
    suite: str
    task_id: int
    name: str
    language: str
    bddl_file: Path
    init_states_file: Path


def list_tasks(suite: str) -> list[LiberoTask]:
    """The tasks of a suite in LIBERO's default order (task order index 0)."""
    check_suite(suite)
    pkg = libero_pkg_dir()
    return [
        LiberoTask(suite, i, name, _language_from_name(name),
                   pkg / "bddl_files" / suite / f"{name}.bddl",
                   pkg / "init_files" / suite / f"{name}.pruned_init")
        for i, name in enumerate(_task_map()[suite])
    ]


def parse_task_ids(task_id: int | Sequence[int] | str, n_tasks: int, suite: str) -> list[int]:
    """The config's ``task_id`` (an index, a list of them or ``"all"``) as suite indices."""
    if isinstance(task_id, str):
        if task_id != "all":
            raise ValueError(f"task_id must be an index, a list of indices or 'all', got {task_id!r}")
        ids = list(range(n_tasks))
    elif isinstance(task_id, (int, np.integer)):
        ids = [int(task_id)]
    else:
        ids = [int(t) for t in task_id]
    bad = [t for t in ids if not 0 <= t < n_tasks]
    if not ids or bad:
        raise ValueError(f"{suite} has tasks 0..{n_tasks - 1}, got task_id={task_id}")
    return ids


class _NumpyOnlyUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"init-state file refers to {module}.{name}")
        return super().find_class(module, name)


def load_init_states(path: str | os.PathLike) -> np.ndarray:
    """A LIBERO ``.pruned_init`` file (a ``torch.save`` zip holding one pickled numpy array)
    as a float64 array [N, D], without torch and without unpickling anything but numpy.
    These are files of the installed LIBERO package, never bytes from the network."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if len(names) != 1 or any(n.split("/")[-2:-1] == ["data"] for n in zf.namelist()):
            raise ValueError(f"{path}: not a pickled numpy array in a torch zip file")
        arr = _NumpyOnlyUnpickler(io.BytesIO(zf.read(names[0]))).load()
    if not isinstance(arr, np.ndarray) or arr.ndim != 2:
        raise ValueError(f"{path}: expected a 2-D array of states, got {type(arr).__name__}")
    return arr
