"""Distributed updates are the single-process updates: 2 ranks (torch.distributed gloo on
loopback, through ``accelerate.Accelerator(cpu=True)``) each given half of every global
batch end with the parameters of 1 process given the whole batches, for SAC and PPO; and
with the gradient sync broken on purpose (``accelerator.no_sync``) they do not, so the
comparison detects a missing all-reduce.

Both ranks run as real processes (``torch.multiprocessing`` spawn, MASTER_ADDR/MASTER_PORT/
RANK/WORLD_SIZE in the environment, as ``accelerate launch`` sets them). Losses are means,
so the mean of the ranks' half-batch gradients is the full-batch gradient; the policy's
Gaussian draw is read from the batch (``eps``) so that each row sees the same noise whichever
rank holds it. PPO's minibatch is the whole round (rank shares are then the same rows as
one process's minibatch), its mask leaves the ranks different numbers of real chunks
(checks the loss scaling), and advantages are whitened (checks the global statistics).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tandem_testutil import free_port

SPEC_KW = dict(state_dim=5, action_dim=2, max_episode_steps=50)
B = 32          # global batch
K = 5           # updates
WORLD = 2


def _policy_cls():
    from agents.policies.mlp import MLPPolicy

    class BatchNoisePolicy(MLPPolicy):
        """The MLP policy with its standard-normal draw read from the batch (``eps`` /
        ``next.eps``), so a row's sample does not depend on which rank holds it."""

        def _draw(self, obs, prefix=""):
            import math

            from agents.policies.mlp import tanh_log_det
            mean, log_std = self.dist_params(obs, prefix)
            eps = obs[prefix + "eps"]
            u = mean + log_std.exp() * eps
            logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - tanh_log_det(u)).sum(-1)
            return torch.tanh(u), logp, eps

    return BatchNoisePolicy


def _sac_batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(K * 2):  # utd_ratio 2
        b = {"observation.state": torch.randn(B, 5, generator=g),
             "next.observation.state": torch.randn(B, 5, generator=g),
             "action": torch.rand(B, 2, generator=g) * 2 - 1, "reward": torch.randn(B, generator=g),
             "terminated": torch.rand(B, generator=g) < 0.1,
             "eps": torch.randn(B, 2, generator=g), "next.eps": torch.randn(B, 2, generator=g)}
        out.append(b)
    return out


def _ppo_batch() -> dict:
    g = torch.Generator().manual_seed(11)
    mask = torch.ones(B, dtype=torch.bool)
    mask[:5] = False  # all in rank 0's half: the ranks hold 11 and 16 real chunks
    return {"observation.state": torch.randn(B, 5, generator=g),
            "action": (torch.rand(B, 1, 2, generator=g) * 2 - 1) * 0.9,
            "old_log_prob": torch.randn(B, generator=g) - 1.0,
            "advantages": torch.randn(B, generator=g) * 2 + 0.5,
            "returns": torch.randn(B, generator=g), "old_values": torch.randn(B, generator=g) * 0.1,
            "mask": mask}


def _share(batch: dict, rank: int, world: int) -> dict:
    n = B // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def run_updates(rank: int, world: int, broken: bool) -> dict[str, torch.Tensor]:
    """K SAC and K PPO updates on this rank's shares; the final parameters by name."""
    from accelerate import Accelerator

    from agents.parallel import accelerator_kwargs
    from agents.policies.mlp import MLPPolicyConfig
    from agents.ppo.agent import PPOAgent, PPOConfig
    from agents.sac.agent import SACAgent, SACConfig
    from agents.common.value import ValueNet, ValueNetConfig
    from data.core.spec import EnvSpec

    spec = EnvSpec(**SPEC_KW)
    acc = Accelerator(cpu=True, kwargs_handlers=accelerator_kwargs())
    assert acc.num_processes == world, (acc.num_processes, world)
    pcfg = MLPPolicyConfig(hidden_dims=(32, 32))
    out: dict[str, torch.Tensor] = {}
    torch.manual_seed(rank)  # different initial weights per rank: prepare broadcasts rank 0's
    sac = SACAgent(SACConfig(batch_size=B, utd_ratio=2, max_grad_norm=1.0, critic_hidden_dims=(32, 32)),
                   _policy_cls()(pcfg, spec), spec, acc)
    torch.manual_seed(0)
    batches = iter([_share(b, rank, world) for b in _sac_batches()])
    for _ in range(K):
        with acc.no_sync(sac.model) if broken else contextlib.nullcontext():
            sac.update(batches)
    for name, mod in (("actor", sac._actor_raw), ("critic", sac._critic_raw),
                      ("target", sac.target_critic), ("temp", sac._temp_raw)):
        out.update({f"sac.{name}.{k}": v.detach().clone() for k, v in mod.state_dict().items()})
    torch.manual_seed(100 + rank)
    ppo = PPOAgent(PPOConfig(epochs=K, minibatch_size=B, max_grad_norm=0.5),
                   _policy_cls()(pcfg, spec), ValueNet(ValueNetConfig(hidden_dims=(16,)), spec), acc)
    torch.manual_seed(0)
    with acc.no_sync(ppo._calls) if broken else contextlib.nullcontext():
        ppo.update(_share(_ppo_batch(), rank, world))
    out.update({f"ppo.policy.{k}": v.detach().clone() for k, v in ppo.policy.state_dict().items()})
    out.update({f"ppo.value.{k}": v.detach().clone() for k, v in ppo.value_fn.state_dict().items()})
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: the synced run, then the broken one (one spawn: importing torch, accelerate
    and dynamo costs more than the updates)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    for broken in (False, True):
        params = run_updates(rank, world, broken)
        save_file({k: v.contiguous() for k, v in params.items()},
                  str(Path(out_dir) / f"{'broken' if broken else 'synced'}_rank{rank}.safetensors"))
    torch.distributed.destroy_process_group()


def _spawn(tmp_path: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    mp.start_processes(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="spawn")
    return {tag: [load_file(str(tmp_path / f"{tag}_rank{r}.safetensors")) for r in range(WORLD)]
            for tag in ("synced", "broken")}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


ATOL = 2e-5  # measured: synced ranks differ from 1 process by <= ~1e-6; broken by >= ~1e-3


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return run_updates(0, 1, broken=False)


def test_two_ranks_equal_one_process_and_broken_sync_is_caught(tmp_path, single):
    runs = _spawn(tmp_path)
    synced, broken = runs["synced"], runs["broken"]
    for algo in ("sac", "ppo"):
        pick = lambda d: {k: v for k, v in d.items() if k.startswith(algo + ".")}  # noqa: E731
        # the ranks agree with each other and with one process on the whole batches
        assert _max_diff(pick(synced[0]), pick(synced[1])) <= ATOL, algo
        diff = _max_diff(pick(synced[0]), pick(single))
        print(f"{algo}: 2 synced ranks vs 1 process: max |diff| {diff:.2e}")
        assert diff <= ATOL, f"{algo}: 2 ranks differ from 1 process by {diff:.2e}"
    for algo in ("sac", "ppo"):
        pick = lambda d: {k: v for k, v in d.items() if k.startswith(algo + ".")}  # noqa: E731
        for r in range(WORLD):
            diff = _max_diff(pick(broken[r]), pick(single))
            print(f"{algo}: rank {r} without gradient sync vs 1 process: max |diff| {diff:.2e}")
            assert diff > 50 * ATOL, f"{algo}: without gradient sync rank {r} still matches ({diff:.2e})"


# -- a 2-rank CPU learner with a real actor --------------------------------------------------
@pytest.mark.slow
def test_two_rank_cpu_learner_trains_an_actor_end_to_end(tmp_path):
    """launch/run_learner.sh --gpus 2 --cpu (torchrun, gloo) + one real actor on loopback:
    the actor acts and its transitions are ingested, both ranks update, rank 0 publishes,
    and the actor's later transitions carry a newer policy version."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import pandas as pd

    from tandem_testutil import ROOT

    run_dir, port, pub = tmp_path / "run", free_port(), free_port()
    common = [f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={pub}",
              "transport.timeout_s=1.0", "transport.heartbeat_s=0.5", "env=inverted_pendulum",
              "policy=mlp", "policy.chunk_size=1"]
    env = {**os.environ, "TANDEM_PYTHON": sys.executable, "TANDEM_RDZV_PORT": str(free_port()),
           "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    learner_log, actor_log = open(tmp_path / "learner.log", "wb"), open(tmp_path / "actor.log", "wb")
    learner = subprocess.Popen(
        ["bash", str(ROOT / "launch" / "run_learner.sh"), "--gpus", "2", "--cpu", *common, "algo=sac",
         "algo.learning_starts=64", "algo.batch_size=32", "algo.publish_every=5",
         "trainer.max_updates=20", "trainer.num_threads=1", "buffer.video=false", "logging.wandb=disabled",
         "logging.every_s=1", "buffer.commit_interval_s=0.5"],
        cwd=ROOT, env=env, stdout=learner_log, stderr=subprocess.STDOUT, start_new_session=True)
    actor = subprocess.Popen([sys.executable, "-m", "actor", *common, "actor_id=a0", "spool.fsync=false",
                              "log_every_s=5"], cwd=ROOT, env=env, stdout=actor_log,
                             stderr=subprocess.STDOUT)
    try:
        learner.wait(150)
        time.sleep(1.0)
    finally:
        for p in (actor, learner):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT) if p is learner else p.send_signal(signal.SIGINT)
        for p in (actor, learner):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    text = (tmp_path / "learner.log").read_text()
    assert learner.returncode == 0 and "Traceback" not in text, text[-4000:]
    st = json.loads((run_dir / "status.json").read_text())
    rank1 = json.loads((run_dir / "rank1.json").read_text())
    print(f"\n2-rank learner: rank 0 {st['updates']} updates, rank 1 {rank1['updates']}, version "
          f"{st['version']}, {st['env_steps']} env steps")
    assert st["env_steps"] >= 64 and st["updates"] == 20 and rank1["updates"] == 20, (st, rank1)
    assert st["version"] == 4, st  # 20 updates / publish_every 5
    versions = pd.concat(pd.read_parquet(f, columns=["policy_version"])
                         for f in (run_dir / "dataset").rglob("data/**/*.parquet"))["policy_version"]
    assert versions.min() == 0 and versions.max() >= 1, versions.value_counts()


if __name__ == "__main__":  # one rank of a launch (torchrun sets RANK, WORLD_SIZE, MASTER_*):
    import sys               # tests/test_multinode.py starts it as two one-process "nodes"

    torch.set_num_threads(1)
    rank_, world_ = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    params_ = run_updates(rank_, world_, broken=False)
    save_file({k: v.contiguous() for k, v in params_.items()},
              str(Path(sys.argv[1]) / f"launch_rank{rank_}.safetensors"))
    torch.distributed.destroy_process_group()
