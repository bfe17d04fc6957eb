"""Real-time chunking through the real learner and actor (``learner.app.Learner``,
``actor.app.Actor``, built from the Hydra configs) on loopback: a tiny PI0 on
``env=point_reach`` with ``rtc.enabled=true`` on the learner and ``chunk.rtc=true`` on the
actor, paced at 25 Hz so that the act latency spans steps. The records the learner ingests hold
exactly the actions the env executed, step for step; chunks join mid-way (``chunk_start`` with
``chunk_index`` = the steps the reply took), and the joined chunk's actions are the reply's
from that index on. Also: the learner refuses RTC with a flow-chain log-probability and with
noise-space SAC at start-up, naming both settings."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from tandem_testutil import ROOT, free_port

H = 8  # policy.chunk_size


def cfg(name, overrides):
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=overrides)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0

    spec = env_spec(cfg("learner", ["env=point_reach", "env.num_tasks=1"]).env)
    return make_pi0(tmp_path_factory.mktemp("rtc") / "pi0", spec, chunk_size=H, image_size=32)


def common(run_dir, port, pub, ckpt):
    return ["env=point_reach", "env.num_tasks=1", "env.max_episode_steps=24", f"run_dir={run_dir}",
            f"transport.port={port}", f"transport.pub_port={pub}", "policy=pi0", f"policy.checkpoint={ckpt}",
            f"policy.chunk_size={H}", "policy.lora_rank=0", "policy.device=cpu", "policy.num_inference_steps=3",
            "policy.fast_warmup_buckets=[]"]


def test_actor_with_rtc_stores_exactly_the_executed_actions(ckpt, tmp_path):
    from actor.app import Actor
    from learner.app import Learner

    run_dir, port, pub = tmp_path / "run", free_port(), free_port()
    learner = Learner(cfg("learner", common(run_dir, port, pub, ckpt) + [
        "algo=rejection_sampling", "algo.eval_episodes=0", "algo.env_steps_per_cycle=100000",
        "device=cpu", "logging.wandb=disabled", "trainer.num_threads=1", "buffer.persist=false",
        "rtc.enabled=true", "rtc.execution_horizon=6"]))
    stored = []
    on_records = learner.ingest.on_records

    def observed(batch, keep):  # what ingest stores (an observer: the learner's own hook still runs)
        stored.append({k: np.array(v)[np.asarray(keep)] for k, v in batch.arrays.items()})
        return on_records(batch, keep)

    learner.ingest.on_records = observed
    lt = threading.Thread(target=learner.run, daemon=True)
    lt.start()
    try:
        actor = Actor(cfg("actor", common(run_dir, port, pub, ckpt) + [
            "actor_id=a0", "spool.fsync=false", "spool.batch_size=8", "max_episodes=3", "drain_s=30",
            "chunk.rtc=true", "chunk.execute=4", "chunk.control_hz=25", "transport.timeout_s=5"]))
        executed, joins = [], []
        step = actor.env.step

        def env_step(action):  # the env's own step, its actions noted
            executed.append(np.array(action, np.float32))
            return step(action)

        actor.env.step = env_step
        rtc = actor.rtc
        join = rtc._join

        def noted(got):  # the reply and the steps it took, as the chunker joins it
            joins.append((np.array(got[0][0]), rtc.flight.steps, rtc.sent_delay))
            return join(got)

        rtc._join = noted
        loop = actor.run()
        assert loop.episodes == 3 and len(actor.spool) == 0, "not every record was acknowledged"
    finally:
        learner.stop()
        lt.join(60)
    recs = {k: np.concatenate([b[k] for b in stored]) for k in stored[0]}
    steps = ~recs["is_last"]
    order = np.lexsort((recs["step"][steps], recs["episode"][steps]))
    actions = recs["action"][steps][order]
    assert len(actions) == len(executed) >= 30  # 3 episodes of <= 24 steps (a lucky reach ends one early)
    np.testing.assert_array_equal(actions, np.stack(executed))  # exactly what ran, bit for bit
    start, index = recs["chunk_start"][steps][order], recs["chunk_index"][steps][order]
    assert rtc.requests >= 6 and rtc.joins >= 6, (rtc.requests, rtc.joins)
    joined = np.flatnonzero(start & (index > 0))
    assert len(joined) >= 4, "chunks never joined mid-way"
    # every join: the step's chunk_index is the delay it took, and the chunk's actions from
    # there on are the reply's from that index (until the next chunk starts)
    by_delay = iter(joins)
    k = 0
    for i in np.flatnonzero(start):
        if index[i] == 0:
            continue
        reply, took, sent = next(by_delay)
        assert index[i] == took and 0 <= sent <= H
        end = np.flatnonzero(start[i + 1:])
        n = int(end[0]) + 1 if len(end) else len(actions) - i
        n = min(n, H - took)
        np.testing.assert_array_equal(actions[i:i + n], reply[took:took + n])
        k += 1
    assert k >= 4
    print(f"\nrtc: requests {rtc.requests}, joins {rtc.joins}, stalls {rtc.stalls} ({rtc.stall_s:.2f} s), "
          f"(sent, took) {rtc.delays}")
    assert max(s for _, _, s in joins) >= 1, "no delay was ever sent (latency not measured)"


@pytest.mark.parametrize("extra, names", [
    (["policy.flow_rl=noise", "algo=ppo"], ("rtc.enabled=true", "policy.flow_rl=noise")),
    (["algo=sac_noise"], ("rtc.enabled=true", "algo=sac_noise")),
])
def test_rtc_refused_with_flow_log_probs_and_noise_sac(extra, names, tmp_path):
    from learner.app import validate

    c = cfg("learner", ["env=point_reach", "policy=pi0", "rtc.enabled=true", f"run_dir={tmp_path}", *extra])
    with pytest.raises(ValueError) as err:
        validate(c)
    for n in names:
        assert n in str(err.value), str(err.value)
    validate(cfg("learner", ["env=point_reach", "policy=pi0", f"run_dir={tmp_path}", *extra]))  # without RTC: fine
