import os
import signal
import sys

import pytest

from tandem_testutil import ROOT, free_port

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

# Bytecode caching for this session and the learner/actor/tool processes the tests start.
# uv installs packages without .pyc files, and with PYTHONDONTWRITEBYTECODE=1 in the
# environment (some containers set it) every one of the ~100 Python processes of a run
# compiled torch, transformers etc. from source again: importing learner.app + actor.app
# took 6.5-7.5 s of CPU instead of 3.1-3.4 s (2-core VM). Writing the cache once makes the
# later processes read it. Nothing the tests check depends on it.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# Run in the background (``nohup uv run --frozen pytest -q &``), pytest starts with SIGINT
# ignored, and an ignored signal stays ignored across exec: every learner, actor and
# launcher script the tests start then ignored the SIGINT the tests stop them with (bash
# cannot even trap it). Teardowns waited out their 15-30 s timeouts before killing, the Ctrl-C
# and restart tests failed, and a launcher's learner kept training after its test. Restoring
# Python's default handler here gives the children SIGINT's default disposition again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def ports():
    return free_port(), free_port()
