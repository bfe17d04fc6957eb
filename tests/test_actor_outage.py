"""A robot never dies because its learner had a bad moment (issue 24, class 2): while the
learner answers ``inference_failed`` (its serving copy produced NaN), a real actor loop holds
its env (nothing steps), backs off, retries and says why in its status; it acts again once
the learner serves. An env that defines its safe behaviour (a robot: stop) gets it once per
outage and starts a new episode after. Real LearnerService + InferenceServer + LearnerClient
on loopback, a real env (point_reach)."""

from __future__ import annotations

import contextlib
import threading
import time

import gymnasium as gym
import torch
import zmq

from actor.client import LearnerClient
from actor.loop import ActorLoop
from actor.spool import Spool
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.replay import ReplayBuffer
from envs.registry import make_env
from envs.spec import spec_from_env
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher
from tandem_testutil import free_port


class StopsOnOutage(gym.Wrapper):
    """An env whose safe behaviour is to stop (as a robot's): the episode cannot go on."""

    def __init__(self, env):
        super().__init__(env)
        self.outages: list[str] = []
        self.resets = 0
        self.resets_at_outage: list[int] = []

    def reset(self, **kw):
        self.resets += 1
        return self.env.reset(**kw)

    def on_policy_outage(self, reason: str) -> bool:
        self.outages.append(reason)
        self.resets_at_outage.append(self.resets)
        return True


def _learner(spec, ctx):
    policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8), spec)
    full = spec.with_extras(policy.extras_spec())
    box = {}
    svc = LearnerService(ctx=ctx, spec=full, config_hash="h", ingest=Ingest(ReplayBuffer(2000, full)),
                         submit_act=lambda r: box["inf"].submit(r), get_version=lambda: box["w"].version,
                         get_weights=lambda: box["w"].latest(), port=free_port(), pub_port=free_port())
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"), batch_window_ms=0.0, act_channel=svc.act_channel)
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(policy.trainable_state_dict(), version=1)
    svc.start()
    inf.start()
    return svc, inf, {k: v.detach().clone() for k, v in policy.trainable_state_dict().items()}


def _run(env, tmp_path, ctx, svc, stop):
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=svc.port, actor_id="a0", config_hash="h",
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=1.0)
    client.connect(give_up_after_s=10)
    loop = ActorLoop(env, client, lambda a, t, d: client.act(a, t, deterministic=d), actor_id="a0",
                     batch_size=8)
    errors: list[BaseException] = []

    def body():
        try:
            loop.run(stop=lambda: stop.is_set())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return loop, client, t, errors


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _poison(inf):
    with torch.no_grad():
        for p in inf.policy.parameters():
            p.fill_(float("nan"))


@contextlib.contextmanager
def _running(env, tmp_path):
    """A learner service + inference server and an actor loop on ``env`` in a thread; yields
    (loop, client, thread, errors, inf, good weights) and stops everything after."""
    ctx = zmq.Context()
    svc, inf, good = _learner(spec_from_env(env), ctx)
    stop = threading.Event()
    loop, client, t, errors = _run(env, tmp_path, ctx, svc, stop)
    try:
        yield loop, client, t, errors, inf, good
    finally:
        stop.set()
        t.join(30)
        inf.stop()
        svc.stop()
        inf.join(2)
        svc.join(2)
        ctx.destroy(0)
    assert not errors, errors


def test_the_actor_holds_backs_off_and_acts_again_when_serving_recovers(tmp_path):
    env = make_env({"name": "point_reach", "image_size": 16})
    with _running(env, tmp_path) as (loop, client, t, errors, inf, good):
        _wait(lambda: loop.steps > 20, 30, "the actor to act")
        _poison(inf)  # the serving copy goes NaN: every act is inference_failed
        _wait(lambda: getattr(loop, "act_failures", 0) >= 3 or not t.is_alive(), 30, "failed acts")
        assert t.is_alive() and not errors, f"the actor loop ended: {errors}"
        assert loop.holding is not None and "inference_failed" in loop.holding and t.is_alive()
        held = loop.steps
        time.sleep(0.5)
        assert loop.steps == held, "the env stepped without an action"
        assert loop._streak >= 3  # backing off: 0.1, 0.2, 0.4 s ...
        inf.set_weights(2, good)  # the learner's next good version
        _wait(lambda: loop.holding is None and loop.steps > held + 20, 30, "the actor to act again")
        assert not errors and t.is_alive() and loop.outages == 1 and client.policy_version == 2
        from actor.console import actor_status
        assert actor_status(loop, client, device=None)["act_failures"] == loop.act_failures


def test_an_env_that_stops_on_an_outage_starts_a_new_episode(tmp_path):
    env = StopsOnOutage(make_env({"name": "point_reach", "image_size": 16}))
    with _running(env, tmp_path) as (loop, client, t, errors, inf, good):
        _wait(lambda: loop.steps > 5, 30, "the actor to act")
        episode = loop.episode  # the episode the outage stops (read before it: the loop moves on at once)
        _poison(inf)
        _wait(lambda: getattr(loop, "act_failures", 0) >= 2 or not t.is_alive(), 30, "failed acts")
        assert t.is_alive() and not errors, f"the actor loop ended: {errors}"
        assert len(env.outages) == 1 and "inference_failed" in env.outages[0]  # once per outage
        inf.set_weights(2, good)
        _wait(lambda: loop.holding is None and loop.steps > 0, 30, "the actor to act again")
        assert loop.episode > episode  # the stopped episode was left; a new one runs
        assert env.resets > env.resets_at_outage[0]  # ... begun by a reset after the stop
