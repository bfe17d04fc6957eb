"""Clean stops on SIGINT and SIGTERM alike, however the process was started (both boxes).

A process started in the background from a script inherits SIGINT ignored (a non-interactive
shell ignores it for background jobs, and an ignored signal stays ignored across exec), and
Python then installs no handler for it: ``kill -INT`` did nothing and the learner trained on.
:class:`StopSignals` installs one handler for both signals explicitly at start: the first one
calls ``on_stop`` and raises KeyboardInterrupt in the main thread (the run loops' clean-stop
path: checkpoint, spool kept); any later one, arriving while the process shuts down, is logged
and ignored rather than breaking the shutdown with a traceback. :meth:`StopSignals.restore`
puts the previous handlers back.
"""

from __future__ import annotations

import logging
import signal
from typing import Callable

log = logging.getLogger("tandem.stops")


class StopSignals:
    def __init__(self, on_stop: Callable[[], None] | None = None,
                 signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.on_stop = on_stop
        self.signals = signals
        #: the signal number that asked for the stop (None: none yet)
        self.received: int | None = None
        self._prev: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers; False (nothing installed) off the main thread (tests running a
        learner or actor in a thread stop it by its own ``stop()``)."""
        try:
            for sig in self.signals:
                self._prev[sig] = signal.signal(sig, self.handle)
        except ValueError:  # not the main thread
            self.restore()
            return False
        return True

    def handle(self, signum, frame=None) -> None:
        if self.received is not None:
            log.warning("%s while stopping: already stopping (ignored)", signal.Signals(signum).name)
            return
        self.received = signum
        log.info("%s: stopping cleanly", signal.Signals(signum).name)
        if self.on_stop is not None:
            self.on_stop()
        raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, prev in self._prev.items():
            try:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self._prev.clear()
