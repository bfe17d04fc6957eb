"""A learner across hosts, tried on this one: two "nodes" started as two separate launches on
loopback (CPU, gloo), each with its own node rank, as two hosts would run them.

- The updates of a rank per launch equal one process's on the same batches (the check of
  tests/test_distributed.py, with torchrun's multi-node rendezvous instead of one spawn).
- ``launch/run_learner.sh --cpu --nodes 2 --node-rank R --main-addr 127.0.0.1`` twice plus a
  real actor: rank 0 (node 0) serves, ingests and publishes, both ranks make every update; a
  resume of that run with another rank count is refused with both counts named.
- Launches whose run_dir is not one shared folder stop at start with a message saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tandem_testutil import ROOT, free_port

ENV = {**os.environ, "TANDEM_PYTHON": sys.executable, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    p.log = log
    return p


def _wait_all(procs, timeout):
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_two_launches_equal_one_process(tmp_path):
    from test_distributed import ATOL, _max_diff, run_updates

    port = free_port()
    procs = [_launch([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(r),
                      "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                      str(ROOT / "tests" / "test_distributed.py"), str(tmp_path)], tmp_path / f"node{r}.log")
             for r in range(2)]
    _wait_all(procs, 240)
    for p in procs:
        assert p.returncode == 0, p.log.read_text()[-3000:]
    ranks = [load_file(str(tmp_path / f"launch_rank{r}.safetensors")) for r in range(2)]
    import torch

    torch.set_num_threads(1)
    single = run_updates(0, 1, broken=False)
    assert _max_diff(ranks[0], ranks[1]) <= ATOL
    diff = _max_diff(ranks[0], single)
    print(f"\n2 launches (1 rank each) vs 1 process, SAC + PPO: max |diff| {diff:.2e}")
    assert diff <= ATOL, diff


def _learner_node(rank: int, run_dir: Path, port: int, rdzv: int, pub: int, log: Path, *over):
    return _launch(["bash", str(ROOT / "launch" / "run_learner.sh"), "--cpu", "--gpus", "1", "--nodes", "2",
                    "--node-rank", str(rank), "--main-addr", "127.0.0.1", "--main-port", str(rdzv),
                    f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
                    "transport.timeout_s=1.0", "transport.heartbeat_s=0.5", "env=inverted_pendulum",
                    "policy=mlp", "policy.chunk_size=1", "algo=sac", "algo.learning_starts=64",
                    "algo.batch_size=32", "algo.publish_every=5", "trainer.max_updates=20",
                    "trainer.num_threads=1", "buffer.video=false", "logging.wandb=disabled",
                    "logging.every_s=1", "buffer.commit_interval_s=0.5", "distributed.timeout_s=60", *over], log)


@pytest.mark.slow
def test_two_node_cpu_learner_trains_an_actor_and_resume_needs_the_same_ranks(tmp_path):
    run_dir, port, pub, rdzv = tmp_path / "run", free_port(), free_port(), free_port()
    nodes = [_learner_node(r, run_dir, port, rdzv, pub, tmp_path / f"node{r}.log") for r in range(2)]
    actor = _launch([sys.executable, "-m", "actor", f"run_dir={run_dir}", f"transport.port={port}",
                     f"transport.pub_port={pub}", "transport.timeout_s=1.0", "transport.heartbeat_s=0.5",
                     "env=inverted_pendulum", "policy=mlp", "policy.chunk_size=1", "actor_id=a0",
                     "spool.fsync=false", "log_every_s=5"], tmp_path / "actor.log")
    try:
        _wait_all(nodes, 200)
    finally:
        if actor.poll() is None:
            actor.send_signal(signal.SIGINT)
        _wait_all([actor], 30)
    for p in nodes:
        text = p.log.read_text()
        assert p.returncode == 0 and "Traceback" not in text, text[-4000:]
    st = json.loads((run_dir / "status.json").read_text())
    rank1 = json.loads((run_dir / "rank1.json").read_text())
    print(f"\n2 nodes: rank 0 {st['updates']} updates, rank 1 {rank1['updates']}, version {st['version']}, "
          f"{st['env_steps']} env steps")
    assert st["env_steps"] >= 64 and st["updates"] == 20 and rank1["updates"] == 20, (st, rank1)
    assert st["version"] == 4, st  # 20 updates / publish_every 5
    # the same run on one process: refused, naming both rank counts
    one = _launch(["bash", str(ROOT / "launch" / "run_learner.sh"), "--cpu", f"run_dir={run_dir}",
                   f"transport.port={free_port()}", f"transport.pub_port={free_port()}",
                   "env=inverted_pendulum", "policy=mlp", "policy.chunk_size=1", "algo=sac",
                   "logging.wandb=disabled", "buffer.video=false"], tmp_path / "one.log")
    _wait_all([one], 120)
    text = one.log.read_text()
    assert one.returncode != 0 and "written by a learner of 2 rank(s)" in text, text[-3000:]


@pytest.mark.slow
def test_nodes_without_a_shared_run_dir_stop_with_a_clear_message(tmp_path):
    port, pub, rdzv = free_port(), free_port(), free_port()
    nodes = [_learner_node(r, tmp_path / f"host{r}" / "run", port, rdzv, pub, tmp_path / f"node{r}.log")
             for r in range(2)]
    _wait_all(nodes, 200)
    for p in nodes:
        text = p.log.read_text()
        assert p.returncode != 0 and "is not the same folder on every learner rank" in text, text[-3000:]
