"""A scripted human takes over during the actor's episodes: the learner receives, over real
loopback sockets, transitions flagged ``intervened`` that carry the human's action."""

import numpy as np
import torch
import zmq

from actor.client import LearnerClient
from actor.loop import ActorLoop
from actor.spool import Spool
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.replay import ReplayBuffer
from envs.intervention import ScriptedIntervention
from envs.registry import make_env
from data.core.spec import config_hash
from envs.spec import spec_from_env
from learner.inference import InferenceServer
from learner.ingest import Ingest
from learner.service import LearnerService
from learner.weights import WeightPublisher

HUMAN = np.array([0.5, -0.25], np.float32)
TAKEOVER = [3, 4, 5, 6]


def test_intervention_reaches_the_learner(tmp_path, ports):
    env_cfg = {"name": "reacher", "max_episode_steps": 20}
    env = make_env(env_cfg, intervention=ScriptedIntervention(takeover=TAKEOVER, action=HUMAN))
    spec = spec_from_env(env)
    chash = config_hash(spec, env_name="reacher", policy_name="mlp", chunk=1)
    ctx = zmq.Context()
    buffer = ReplayBuffer(1000, spec)
    ingest = Ingest(buffer)
    policy = MLPPolicy(MLPPolicyConfig(hidden_dims=(16,)), spec)
    box = {}
    svc = LearnerService(ctx=ctx, spec=spec, config_hash=chash, ingest=ingest,
                         submit_act=lambda r: box["inf"].submit(r), get_version=lambda: box["w"].version,
                         get_weights=lambda: box["w"].latest(), port=ports[0], pub_port=ports[1])
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors,
                          device=torch.device("cpu"))
    box["inf"], box["w"] = inf, WeightPublisher(inf.set_weights, svc.publish)
    box["w"].publish(policy.trainable_state_dict(), version=3)
    svc.start()
    inf.start()
    client = LearnerClient(ctx=ctx, host="127.0.0.1", port=ports[0], actor_id="arm", config_hash=chash,
                           spool=Spool(tmp_path / "spool", fsync=False), timeout_s=2.0)
    try:
        client.connect(give_up_after_s=20)
        loop = ActorLoop(env, client, lambda a, t, d: client.act(a, t, deterministic=d),
                         actor_id="arm", batch_size=8)
        loop.run(max_episodes=2)
        for _ in range(100):
            if len(client.spool) == 0:
                break
            client.poll(0.05)
        assert len(client.spool) == 0, "the learner did not acknowledge everything"
    finally:
        client.close()
        inf.stop()
        svc.stop()
        inf.join(2)
        svc.join(2)
        env.close()
    batch = buffer.sample(2000)  # uniform with replacement: covers all 40 steps
    steps = batch["step"].numpy()
    intervened = batch["intervened"].numpy()
    actions = batch["action"].numpy()
    assert set(steps[intervened].tolist()) == set(TAKEOVER)
    assert not intervened[~np.isin(steps, TAKEOVER)].any()
    np.testing.assert_allclose(actions[intervened], np.broadcast_to(HUMAN, actions[intervened].shape))
    # policy steps carry the served version; human steps still record it
    assert (batch["policy_version"].numpy() == 3).all()
    assert buffer.total_added == 2 * (20 + 1)
