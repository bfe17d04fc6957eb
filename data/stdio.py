"""The process's stdout and stderr while a live view redraws the terminal, for both boxes.

The views themselves (rich) are each box's own: :class:`learner.console.LiveView`,
:class:`actor.console.LiveView` subclass :class:`TerminalTakeover` with ``make_live``. What is
here imports no UI library: when a view may start (enabled, stdout a terminal, the library
installed), log lines that keep printing above it, and native writes straight to file
descriptors 1 and 2 (video encoders, ...) sent to a file instead of breaking the redraw.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable


class TerminalTakeover:
    """A live view's hold on the terminal while it redraws ``get_renderable()``.

    Inactive (start/stop do nothing) unless ``enabled``, stdout is a terminal and the view's
    library is installed (``make_live`` raises ImportError: a thin install may lack it, then
    the plain status lines are all there is). ``stray_output``: while live, output written
    straight to file descriptors 1 and 2 goes to this file."""

    def __init__(self, get_renderable: Callable[[], Any], *, enabled: bool = True,
                 refresh_per_second: float = 2.0, stray_output: str | None = None):
        self.get_renderable = get_renderable
        self.stray_output = stray_output
        self._saved_fds: list[tuple[int, int]] = []
        self.enabled = enabled
        self.refresh_per_second = refresh_per_second
        self.live = None
        self._streams: list[tuple[logging.StreamHandler, Any]] = []

    @property
    def active(self) -> bool:
        return self.live is not None

    def make_live(self, tty):
        """The view, not started: an object with ``start``/``stop`` that redirects
        ``sys.stdout``/``sys.stderr`` while started. ``tty``: a file on the terminal to draw on
        (with ``stray_output``: fd 1 then no longer is one), else None (stdout)."""
        raise NotImplementedError

    def render(self, text: Callable[[str], Any]):
        """``get_renderable()``, or ``text(...)`` naming its failure: a view bug must never stop
        the process (or the robot)."""
        try:
            return self.get_renderable()
        except Exception as exc:
            return text(f"(status view failed: {type(exc).__name__}: {exc})")

    def start(self) -> "TerminalTakeover":
        if not self.enabled or not sys.stdout.isatty():
            return self
        out, tty = sys.stdout, None
        if self.stray_output:
            sys.stdout.flush()
            sys.stderr.flush()
            tty = os.fdopen(os.dup(1), "w", buffering=1)
        try:
            live = self.make_live(tty)
        except ImportError:
            if tty is not None:
                tty.close()
            logging.getLogger("tandem").info("no live view: rich is not installed (plain status "
                                             "lines; `--group viz` adds it to a thin install)")
            return self
        if self.stray_output:
            stray = os.open(self.stray_output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for fd in (1, 2):
                self._saved_fds.append((fd, os.dup(fd)))
                os.dup2(stray, fd)
            os.close(stray)
        self.live = live
        live.start()
        for name in [None, *logging.root.manager.loggerDict]:  # log lines print above the view
            lg = logging.getLogger(name)
            for h in getattr(lg, "handlers", []):
                if isinstance(h, logging.StreamHandler) and h.stream in (out, sys.__stdout__, sys.__stderr__):
                    self._streams.append((h, h.stream))
                    h.setStream(sys.stdout)  # the view's proxy while live
        return self

    def stop(self) -> None:
        if self.live is None:
            return
        for h, stream in self._streams:
            h.setStream(stream)
        self._streams.clear()
        try:
            self.live.stop()
        finally:
            self.live = None
            for fd, saved in self._saved_fds:
                os.dup2(saved, fd)
                os.close(saved)
            self._saved_fds.clear()
