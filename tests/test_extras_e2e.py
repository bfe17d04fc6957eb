"""Policy extras end to end: the MLP policy's ``log_prob`` and its Gaussian ``noise``
[H, A] go from ``policy.act`` through the act reply (remote) or the actor's own policy copy
(local), the actor's records, ingest, the replay buffer's sampled batches and the LeRobot
dataset on disk.

The real ``learner.app.Learner`` and ``actor.app.Actor``, built from the Hydra configs, talk
over loopback sockets (env=inverted_pendulum, a chunk of 3 actions, SAC training so that
weight versions advance during the run). The checks are exact: every stored chunk's
actions are ``tanh(mean + std * noise)`` and its ``log_prob`` the density of that draw under
the mean and std of the weights version the record names, and the stored chunks are, one
for one and in order, the act replies the actor received.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from tandem_testutil import ROOT, free_port

H = 3  # policy.chunk_size


def compose_cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=overrides)


def common(run_dir, port, pub) -> list[str]:
    return ["env=inverted_pendulum", "env.max_episode_steps=40", f"run_dir={run_dir}",
            f"transport.port={port}", f"transport.pub_port={pub}", "transport.timeout_s=1.0",
            "transport.heartbeat_s=0.5", "policy=mlp", f"policy.chunk_size={H}",
            "policy.hidden_dims=[32,32]"]


def learner_cfg(run_dir, port, pub, *extra):
    return compose_cfg("learner", common(run_dir, port, pub) + [
        "device=cpu", "logging.wandb=disabled", "logging.every_s=1", "trainer.num_threads=1",
        "algo.learning_starts=16", "algo.publish_every=2", "algo.batch_size=16", "algo.utd_ratio=1",
        "algo.critic_hidden_dims=[32,32]", "buffer.commit_interval_s=0.2", *extra])


def actor_cfg(run_dir, port, pub, actor_id, *extra):
    return compose_cfg("actor", common(run_dir, port, pub) + [
        f"actor_id={actor_id}", "spool.fsync=false", "spool.batch_size=8", "log_every_s=1",
        "drain_s=30", *extra])


class LearnerThread:
    """``Learner.run()`` on a thread, stopped with :meth:`Learner.stop`."""

    def __init__(self, learner):
        self.learner = learner
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.result = self.learner.run()
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def start(self):
        self.thread.start()
        return self

    def stop(self, timeout: float = 60.0):
        self.learner.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the learner did not stop"
        if self.error is not None:
            raise self.error


def tap_versions(learner) -> dict[int, dict[str, torch.Tensor]]:
    """Every weights version the learner publishes, as published (an observer: the
    publisher's behaviour is unchanged)."""
    from data.core.weights import from_wire

    v, arrays, bf16 = learner.weights.latest()
    snaps = {v: from_wire(arrays, bf16)}
    publish = learner.weights.publish

    def observed(state, version=None):
        v = publish(state, version)
        snaps[v] = {k: t.detach().cpu().clone() for k, t in state.items()}
        return v

    learner.weights.publish = observed
    return snaps


def tap_replies(actor) -> list[dict]:
    """What the actor's loop gets from its policy on each query (remote reply or local copy)."""
    got: list[dict] = []
    act = actor._act

    def observed(arrays, tasks, deterministic):
        actions, version, extras = act(arrays, tasks, deterministic)
        got.append({"state": np.array(arrays["observation.state"][0]), "actions": np.array(actions[0]),
                    "version": version, **{k: np.array(v[0]) for k, v in extras.items()}})
        return actions, version, extras

    actor._act = observed
    return got


def dataset_frames(root):
    """All frames of the dataset, per (actor, actor episode), in step order."""
    from data.store import read_episodes

    eps = {}
    for ep in read_episodes(root):
        c = ep.columns
        eps[(str(c["actor_id"][0]), int(c["actor_episode"][0]))] = c
    return eps


def check_chunks(eps, snaps, policy_cfg, spec, replies):
    """Exact checks of every stored chunk against the weights version it names, and against
    the act replies the actor received (one chunk_start frame per reply, in order)."""
    from agents import registry
    from agents.policies.mlp import tanh_log_det

    policy = registry.build_policy(policy_cfg, spec).eval()
    starts = []
    n_chunks_checked = 0
    for key in sorted(eps):
        c = eps[key]
        n = len(c["frame_index"])
        assert (c["frame_index"] == np.arange(n)).all()
        last = c["is_last"].astype(bool)
        assert last[-1] and not last[:-1].any()
        # the final-observation record: no policy query, zero extras
        assert not c["chunk_start"][-1] and c["chunk_index"][-1] == 0
        assert c["extra.log_prob"][-1] == 0 and (c["extra.noise"][-1] == 0).all()
        assert (c["group_id"] == -1).all()  # no jobs in this run
        cs = np.flatnonzero(c["chunk_start"][:-1])
        assert cs[0] == 0 and not c["intervened"].any()
        bounds = list(cs) + [n - 1]
        for s, e in zip(bounds[:-1], bounds[1:]):
            k = e - s
            assert 1 <= k <= H and (k == H or e == n - 1), "a chunk ended early without the episode"
            assert (c["chunk_index"][s:e] == np.arange(k)).all()
            for col in ("extra.log_prob", "extra.noise", "policy_version"):
                assert (c[col][s:e] == c[col][s]).all(), f"{col} changes within a chunk"
            version = int(c["policy_version"][s])
            policy.load_trainable_state_dict(snaps[version])
            obs = {"observation.state": torch.from_numpy(np.array(c["observation.state"][s:s + 1],
                                                                  np.float32))}
            with torch.no_grad():
                mean, log_std = policy.dist_params(obs)
            noise = torch.from_numpy(np.array(c["extra.noise"][s], np.float32)).reshape(1, -1)
            assert noise.abs().sum() > 0
            u = mean + log_std.exp() * noise
            want_actions = torch.tanh(u).reshape(H, -1).numpy()
            np.testing.assert_allclose(np.asarray(c["action"][s:e]).reshape(k, -1), want_actions[:k], atol=1e-5)
            want_lp = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
                       - tanh_log_det(u)).sum(-1)
            np.testing.assert_allclose(c["extra.log_prob"][s], want_lp.numpy()[0], rtol=1e-4, atol=1e-4)
            starts.append((key, s, c["extra.log_prob"][s], c["extra.noise"][s], version,
                           c["observation.state"][s]))
            n_chunks_checked += 1
    # one stored chunk per reply the actor received, in order, with the same values
    assert len(starts) == len(replies)
    for (key, s, lp, noise, version, state), r in zip(starts, replies):
        assert version == r["version"], (key, s)
        np.testing.assert_array_equal(state, r["state"])
        assert lp == r["extra.log_prob"]
        np.testing.assert_array_equal(noise, r["extra.noise"])
    return n_chunks_checked


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["remote", "local"])
def test_extras_from_policy_to_replay_and_dataset(mode, tmp_path):
    from actor.app import Actor
    from learner.app import Learner

    run_dir = tmp_path / "run"
    port, pub = free_port(), free_port()
    lcfg = learner_cfg(run_dir, port, pub)
    learner = Learner(lcfg)
    assert learner.spec.extras == {"log_prob": ("float32", ()), "noise": ("float32", (H, 1))}
    snaps = tap_versions(learner)
    lt = LearnerThread(learner).start()
    sample = None
    try:
        replies = []
        for phase, episodes in enumerate((6, 4)):  # the learner trains and publishes in between
            actor = Actor(actor_cfg(run_dir, port, pub, "a0", f"mode={mode}", f"max_episodes={episodes}"))
            got = tap_replies(actor)
            loop = actor.run()
            replies += got
            assert loop.episodes == episodes and len(actor.spool) == 0, "not everything was acknowledged"
            deadline = time.monotonic() + 120
            while phase == 0 and learner.weights.version < 2 and time.monotonic() < deadline:
                assert lt.thread.is_alive(), lt.error
                time.sleep(0.1)
        # the replay buffer's sampled batches carry the extras
        sink = learner.data.sink
        sample = sink.sample(256)
    finally:
        lt.stop()
    assert max(r["version"] for r in replies) >= 2, "weight versions did not advance during the run"
    assert sample["extra.log_prob"].shape == (256,) and sample["extra.log_prob"].dtype == torch.float32
    assert sample["extra.noise"].shape == (256, H, 1)
    eps = dataset_frames(run_dir / "dataset")
    assert len(eps) == 10
    n = check_chunks(eps, snaps, lcfg.policy, learner.spec, replies)
    assert n >= 10
    # sampled records hold exactly the values stored for them
    for i in range(256):
        c = eps[("a0", int(sample["episode"][i]))]
        t = int(sample["step"][i])
        assert float(sample["extra.log_prob"][i]) == float(c["extra.log_prob"][t])
        np.testing.assert_array_equal(sample["extra.noise"][i].numpy(), c["extra.noise"][t])
        assert bool(sample["chunk_start"][i]) == bool(c["chunk_start"][t])
        assert int(sample["chunk_index"][i]) == int(c["chunk_index"][t])
    # lerobot's own loader sees the same columns
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("tandem/replay", root=run_dir / "dataset", video_backend="pyav")
    assert tuple(ds.meta.features["extra.noise"]["shape"]) == (H, 1)
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        c = eps[("a0", int(item["actor_episode"]))]
        t = int(item["frame_index"])
        assert float(item["extra.log_prob"]) == float(c["extra.log_prob"][t])
        np.testing.assert_array_equal(item["extra.noise"].numpy(), c["extra.noise"][t])


def test_intervened_steps_carry_the_interrupted_chunk(tmp_path):
    """A scripted human takes over mid-chunk (steps 4 and 5 of chunks starting at 0, 3, ...):
    the human's steps are not chunk starts, keep the interrupted chunk's position and extras,
    and the policy starts a new chunk once the human lets go (documented in actor/loop.py)."""
    import zmq

    from actor.client import LearnerClient
    from actor.loop import ActorLoop
    from actor.spool import Spool
    from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
    from data.core.spec import config_hash
    from data.replay import ReplayBuffer
    from envs.intervention import ScriptedIntervention
    from envs.registry import make_env
    from envs.spec import spec_from_env
    from learner.inference import InferenceServer
    from learner.ingest import Ingest
    from learner.service import LearnerService

    human = np.array([0.5, -0.25], np.float32)
    env = make_env({"name": "reacher", "max_episode_steps": 12},
                   intervention=ScriptedIntervention(takeover=[4, 5], action=human))
    policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), chunk_size=H), spec_from_env(env))
    spec = spec_from_env(env).with_extras(policy.extras_spec())
    chash = config_hash(spec, env_name="reacher", policy_name="mlp", chunk=H)
    ctx = zmq.Context()
    buffer = ReplayBuffer(100, spec)
    port, pub = free_port(), free_port()
    svc = LearnerService(ctx=ctx, spec=spec, config_hash=chash, ingest=Ingest(buffer),
                         submit_act=lambda r: inf.submit(r), get_version=lambda: 0,
                         get_weights=lambda: None, port=port, pub_port=pub)
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"))
    svc.start()
    inf.start()
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=port, actor_id="arm", config_hash=chash,
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=2.0)
    replies = []

    def act(arrays, tasks, deterministic):
        out = client.act(arrays, tasks, deterministic=deterministic)
        replies.append(out[2])
        return out

    try:
        client.connect(give_up_after_s=20)
        ActorLoop(env, client, act, actor_id="arm", batch_size=4).run(max_episodes=1)
        for _ in range(100):
            if len(client.spool) == 0:
                break
            client.poll(0.05)
        assert len(client.spool) == 0
    finally:
        client.close()
        inf.stop()
        svc.stop()
        inf.join(2)
        svc.join(2)
        env.close()
        ctx.destroy(0)
    b = buffer.sample(2000)  # with replacement: covers all 12 transitions
    by_step = {}
    for i in range(len(b["step"])):
        by_step[int(b["step"][i])] = i
    assert sorted(by_step) == list(range(12))
    col = {k: np.array([b[k][by_step[t]].numpy() for t in range(12)])
           for k in ("chunk_start", "chunk_index", "intervened", "extra.log_prob", "extra.noise")}
    # policy queries at 0, 3 (interrupted by the human at 4), 5 (overridden: still the
    # human's step), 6 (the human let go: a new chunk), 9
    assert col["intervened"].tolist() == [t in (4, 5) for t in range(12)]
    assert col["chunk_start"].tolist() == [t in (0, 3, 6, 9) for t in range(12)]
    assert col["chunk_index"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 0, 1, 2]
    assert len(replies) == 5
    which = [0, 0, 0, 1, 1, 2, 3, 3, 3, 4, 4, 4]  # the reply each step's extras come from
    for t, r in enumerate(which):
        assert col["extra.log_prob"][t] == replies[r]["extra.log_prob"][0]
        np.testing.assert_array_equal(col["extra.noise"][t], replies[r]["extra.noise"][0])
