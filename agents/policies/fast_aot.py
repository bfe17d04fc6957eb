"""Ahead-of-time compiled functions for the fast serving paths: what ``torch.compile`` traces
at start-up, traced once and shipped.

Why: with the kernels already in inductor's cache (a restart, or the shipped compile artefacts
of ``inference.compile_artifacts``), a start still spends seconds per compiled stage on the host:
dynamo traces the Python again, AOTAutograd and inductor look their results up
(``tools/bench/trace_cost.py``: PI0 at full depth, ~16-18 s). torch's ahead-of-time compile
(``torch.compile(fn, fullgraph=True).aot_compile(example inputs)``, ``save_compiled_function``,
``torch.compiler.load_compiled_function``) keeps the traced and compiled function itself, so a
later process loads it and calls it without tracing (``tools/bench/aot_start.py``).

:class:`AotFunctions` wraps one function ``fn(module, *tensors)`` whose first argument is the
module it reads its weights from (the weights are then read live, as ``torch.compile``'s are: new
weights written in place need nothing). Per ``key`` (what the call's graph depends on beyond the
marked-dynamic sizes: batch 1 or more, the adapters' fold state, FP8, the dtype; the caller says)
it loads ``folder/aot-<who>-<digest>.bin`` when there, else compiles ahead of time from the
call's own inputs (their ``mark_dynamic`` dims stay symbolic) and saves it there (written aside,
then renamed). The digest covers the key, the device's name, the torch version and ``model``
(the model's config), so a file of another model, GPU or torch is never loaded. A file that does
not load, or whose guards refuse a call, is reported, compiled anew and replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Callable

import torch

from agents.policies.fast_common import device_name

log = logging.getLogger("tandem.policies.aot")


#: guards a saved function keeps no copy of: they hold an object's identity or its class (a
#: process-local fact; lerobot's decoder layers' class is made inside a function and cannot be
#: pickled). What they would check, the file's digest covers: the model's config, the key.
IDENTITY_GUARDS = ("ID_MATCH", "TYPE_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH")


def portable_guards(entries) -> list[bool]:
    """The guards an ahead-of-time function keeps (``guard_filter_fn``): not the global ones, not
    those torch cannot serialize, not :data:`IDENTITY_GUARDS` and none on a class's bases."""
    from torch._dynamo.guards import CheckFunctionManager

    drop = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES) | set(IDENTITY_GUARDS)
    return [not (g.is_global or g.guard_type in drop or drop & set(getattr(g.orig_guard, "guard_types", None) or ())
                 or "__mro__" in g.name)  # (a class's bases: how lerobot built the class in this process)
            for g in entries]


class AotFunctions:
    """``fn`` compiled ahead of time per key, loaded from / saved to ``folder`` (module doc).
    ``loaded`` / ``compiled`` count the keys each way (tests and logs read them)."""

    def __init__(self, fn: Callable, folder: str | os.PathLike, who: str, model: Any, *, dynamic: bool = True,
                 fallback: Callable | None = None):
        self.fn, self.folder, self.who, self.dynamic = fn, os.path.expanduser(str(folder)), who, dynamic
        #: called as ``fn`` is, for a key whose ahead-of-time compile fails (None: the error is raised)
        self.fallback = fallback
        self.failed = 0
        self.model = repr(model)
        self.loaded = self.compiled = 0
        self.load_s = self.compile_s = 0.0
        self._fns: dict[tuple, Callable] = {}

    def path(self, key: tuple, device: torch.device) -> str:
        ident = repr((key, device_name(device), torch.__version__, self.model))
        digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
        return os.path.join(self.folder, f"aot-{self.who}-{digest}.bin")

    def __call__(self, key: tuple, module, *tensors: torch.Tensor):
        key = (*key, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._load(key, tensors[0].device) or self._compile_or_fall_back(key, module, tensors)
        try:
            return fn(module, *tensors)
        except RuntimeError as exc:
            if "GuardManager check failed" not in str(exc):
                raise
            log.warning("%s: the ahead-of-time function for %s refused this call (%s); compiling it anew",
                        self.who, key, str(exc).splitlines()[0])
            fn = self._fns[key] = self._compile(key, module, tensors)
            return fn(module, *tensors)

    def _load(self, key: tuple, device: torch.device) -> Callable | None:
        path = self.path(key, device)
        if not os.path.isfile(path):
            return None
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
        except Exception as exc:  # noqa: BLE001 - a stale or damaged file must not stop serving
            log.warning("%s: %s not loaded (%s: %s); compiling instead", self.who, path, type(exc).__name__, exc)
            return None
        self.loaded += 1
        self.load_s += time.perf_counter() - t0
        log.info("%s: ahead-of-time function for %s loaded from %s (%.1f s)", self.who, key, path,
                 time.perf_counter() - t0)
        return fn

    def _compile_or_fall_back(self, key: tuple, module, tensors: tuple) -> Callable:
        try:
            return self._compile(key, module, tensors)
        except Exception as exc:  # noqa: BLE001 - with a fallback, a stage that will not compile ahead of time still serves
            if self.fallback is None:
                raise
            self.failed += 1
            log.warning("%s: the ahead-of-time compile for %s failed (%s: %s); this key runs the fallback",
                        self.who, key, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return self.fallback

    def _compile(self, key: tuple, module, tensors: tuple) -> Callable:
        t0 = time.perf_counter()
        old = torch._dynamo.config.enable_aot_compile
        torch._dynamo.config.enable_aot_compile = True
        try:
            fn = torch.compile(self.fn, fullgraph=True, dynamic=None if self.dynamic else False,
                               options={"guard_filter_fn": portable_guards}).aot_compile(((module, *tensors), {}))
        finally:
            torch._dynamo.config.enable_aot_compile = old
        path = self.path(key, tensors[0].device)
        os.makedirs(self.folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fn.save_compiled_function(tmp)
        os.replace(tmp, path)
        self.compiled += 1
        self.compile_s += time.perf_counter() - t0
        log.info("%s: ahead-of-time function for %s compiled (%.1f s), saved to %s", self.who, key,
                 time.perf_counter() - t0, path)
        return fn
