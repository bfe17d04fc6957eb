import os
import sys

import pytest

from tandem_testutil import ROOT, free_port

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture
def ports():
    return free_port(), free_port()
