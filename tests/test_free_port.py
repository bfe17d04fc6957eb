"""The tests' port picker: many ports in a row are distinct and never within 2 of each other
(the OS hands a just-released port straight back; a learner also binds ``port + 2``), and under
pytest-xdist a worker keeps to its own blocks of 16 ports so two workers never pick the same."""

import os
import subprocess
import sys

from tandem_testutil import ROOT, free_port


def test_ports_in_a_row_are_distinct_and_apart():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(abs(a - b) > 2 for i, a in enumerate(ports) for b in ports[i + 1:])


def test_each_xdist_worker_keeps_to_its_own_blocks():
    code = ("import sys; sys.path.insert(0, 'tests'); from tandem_testutil import free_port; "
            "print(sorted({(free_port() // 16) % 2 for _ in range(40)}))")
    for worker, want in (("gw0", "[0]"), ("gw1", "[1]")):
        env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": "2"}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip() == want, out.stderr
