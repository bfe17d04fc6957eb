"""The live terminal view both boxes show (learner/console.py, actor/console.py render what
goes in it): a rich ``Live`` that redraws a renderable while log lines print above it."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable


class LiveView:
    """A rich ``Live`` that redraws ``get_renderable()`` while log lines print above it.

    Inactive (start/stop do nothing) unless ``enabled``, stdout is a terminal and rich is
    installed (a thin install may lack it: then the plain status lines are all there is)."""

    def __init__(self, get_renderable: Callable[[], Any], *, enabled: bool = True,
                 refresh_per_second: float = 2.0, stray_output: str | None = None):
        self.get_renderable = get_renderable
        #: while live, output written straight to file descriptors 1 and 2 (native libraries:
        #: video encoders, ...) goes to this file instead of breaking the view's redraw
        self.stray_output = stray_output
        self._saved_fds: list[tuple[int, int]] = []
        self.enabled = enabled
        self.refresh_per_second = refresh_per_second
        self.live = None
        self._streams: list[tuple[logging.StreamHandler, Any]] = []

    @property
    def active(self) -> bool:
        return self.live is not None

    def _safe(self):
        try:
            return self.get_renderable()
        except Exception as exc:  # a view bug must never stop the process (or the robot)
            from rich.text import Text

            return Text(f"(status view failed: {type(exc).__name__}: {exc})")

    def start(self) -> "LiveView":
        if not self.enabled or not sys.stdout.isatty():
            return self
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:
            logging.getLogger("tandem").info("no live view: rich is not installed (plain status "
                                             "lines; `--group viz` adds it to a thin install)")
            return self

        out = sys.stdout
        console = Console()
        if self.stray_output:
            import os

            sys.stdout.flush()
            sys.stderr.flush()
            tty = os.fdopen(os.dup(1), "w", buffering=1)
            console = Console(file=tty, force_terminal=True, width=console.width, height=console.height)
            stray = os.open(self.stray_output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for fd in (1, 2):
                self._saved_fds.append((fd, os.dup(fd)))
                os.dup2(stray, fd)
            os.close(stray)
        self.live = Live(console=console, get_renderable=self._safe, redirect_stdout=True,
                         redirect_stderr=True, refresh_per_second=self.refresh_per_second)
        self.live.start()
        for name in [None, *logging.root.manager.loggerDict]:  # log lines print above the view
            lg = logging.getLogger(name)
            for h in getattr(lg, "handlers", []):
                if isinstance(h, logging.StreamHandler) and h.stream in (out, sys.__stdout__, sys.__stderr__):
                    self._streams.append((h, h.stream))
                    h.setStream(sys.stdout)  # rich's proxy while live
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
            import os

            for fd, saved in self._saved_fds:
                os.dup2(saved, fd)
                os.close(saved)
            self._saved_fds.clear()
