"""Stand-in modules swapped into a policy around its fast serving path's own calls (PI0's FP8
expert's linears, the fused projections), with the weights they were built from kept current.

A site is one place in the model: the module there now (``live()``), the one the stand-in was
built over (``bound``), the parameters it was computed from (``srcs``, with their in-place write
counters ``versions`` at the time), ``refresh()`` (recompute the stand-in's weights in place:
a CUDA graph reads them) and ``install()`` / ``restore()``. :class:`StandIns` syncs its sites
before a call (the per-call case, nothing changed, costs ~0.1 us per source on the host) and
swaps them in around the call.
"""

from __future__ import annotations

import contextlib
from operator import attrgetter

import torch

#: a tensor's in-place write counter (bumped by every write through it)
VERSION = attrgetter("_version")


class Site:
    """What :class:`StandIns` asks of a site (the module docstring); subclasses set the rest."""

    bound: list  # set by bind(), from refresh()
    srcs: list[torch.Tensor]
    versions: list[int]

    def bind(self, bound: list, srcs: list[torch.Tensor]) -> None:
        """Record what the stand-in was just computed from (refresh() ends with this)."""
        self.bound, self.srcs, self.versions = bound, srcs, list(map(VERSION, srcs))

    def live(self) -> list:
        raise NotImplementedError

    def refresh(self) -> None:
        raise NotImplementedError

    def installed(self) -> bool:
        raise NotImplementedError

    def install(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def stale(self) -> bool:
        return self.live() != self.bound or list(map(VERSION, self.srcs)) != self.versions


class StandIns:
    """``sites`` synced by :meth:`sync` and swapped in by :meth:`swapped`; ``what`` names them
    in errors. ``refreshed`` counts the sites recomputed by sync."""

    def __init__(self, sites: list[Site], what: str):
        self.sites, self.what = sites, what
        self.refreshed = 0
        self._flatten()

    def _flatten(self) -> None:
        self._bound = [m for s in self.sites for m in s.bound]
        self._srcs = [p for s in self.sites for p in s.srcs]
        self._versions = list(map(VERSION, self._srcs))

    def sync(self, force: bool = False) -> int:
        """Recompute, in place, each site whose modules or source parameters changed; how many."""
        if not force and [m for s in self.sites for m in s.live()] == self._bound \
                and list(map(VERSION, self._srcs)) == self._versions:
            return 0  # the per-call case
        n = 0
        with torch.inference_mode(False), torch.no_grad():
            for s in self.sites:
                if s.installed():
                    raise RuntimeError(f"{self.what}: sync inside swapped()")
                if force or s.stale():
                    s.refresh()
                    n += 1
        self._flatten()
        self.refreshed += n
        return n

    @contextlib.contextmanager
    def swapped(self):
        """The stand-ins in place; the original modules back after."""
        done = []
        try:
            for s in self.sites:
                if s.live() != s.bound:  # weights written since only make the call read them stale
                    raise RuntimeError(f"{self.what}: a module changed since the last sync (call sync() first)")
                s.install()
                done.append(s)
            yield
        finally:
            for s in done:
                s.restore()


@contextlib.contextmanager
def nested(*contexts):
    """The contexts (None: none) entered in order, left in reverse."""
    with contextlib.ExitStack() as stack:
        for c in contexts:
            if c is not None:
                stack.enter_context(c)
        yield
