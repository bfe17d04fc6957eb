"""The cheap MuJoCo tasks (envs/pendulum.py, envs/reacher.py) and an end-to-end learning check for SAC.

The learning test runs the same in-process loop as a one-laptop demo would: env ->
``MLPPolicy.act`` -> ``TransitionBatch.from_records`` -> ``ReplayBuffer`` ->
``SACAgent.update``, on one CPU thread, and compares the trained policy with a random
policy measured in the same test.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from agents.sac.agent import SACAgent, SACConfig
from data.replay import ReplayBuffer
from data.core.schema import OBS_STATE
from data.core.transitions import TransitionBatch
from envs.pendulum import PENDULUM_ID, make_inverted_pendulum_env  # registers the tandem/* ids
from envs.reacher import REACHER_ID, make_reacher_env
from data.core.spec import EnvSpec
from envs.spec import spec_from_env


# -- the envs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id, state_dim, action_dim, steps",
                         [(REACHER_ID, 10, 2, 50), (PENDULUM_ID, 4, 1, 100)])
def test_env_layout_and_spec(env_id, state_dim, action_dim, steps):
    env = gym.make(env_id)
    spec = spec_from_env(env)
    assert spec == EnvSpec(state_dim=state_dim, action_dim=action_dim, max_episode_steps=steps)
    assert env.action_space == gym.spaces.Box(-1.0, 1.0, (action_dim,), np.float32)
    obs, info = env.reset(seed=0)
    assert set(obs) == {OBS_STATE}
    assert obs[OBS_STATE].dtype == np.float32 and obs[OBS_STATE].shape == (state_dim,)
    assert isinstance(info["is_success"], bool)
    env.action_space.seed(0)
    _, _, terminated, truncated, info = env.step(env.action_space.sample())
    assert isinstance(info["is_success"], bool)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)


def test_reacher_truncates_at_the_time_limit_and_never_terminates():
    env = make_reacher_env(max_episode_steps=30, seed=1)
    env.reset()
    for t in range(1, 31):
        _, _, terminated, truncated, info = env.step(env.action_space.sample())
        assert not terminated
        assert truncated == (t == 30)
        assert info["is_success"] == (info["distance"] <= env.get_wrapper_attr("success_threshold"))
    always = make_reacher_env(success_threshold=1.0, seed=1)  # every reachable point succeeds
    _, info = always.reset()
    assert info["is_success"]


def test_reacher_seed_is_reproducible_and_actions_are_clipped():
    a, b = make_reacher_env(seed=5), make_reacher_env(seed=5)
    oa, _ = a.reset()
    ob, _ = b.reset()
    np.testing.assert_array_equal(oa[OBS_STATE], ob[OBS_STATE])
    oa, ra, *_ = a.step(np.array([7.0, -9.0], np.float32))  # out of range: clipped to the box
    ob, rb, *_ = b.step(np.array([1.0, -1.0], np.float32))
    np.testing.assert_array_equal(oa[OBS_STATE], ob[OBS_STATE])
    assert ra == rb


def test_pendulum_action_is_rescaled_to_the_actuator_range():
    """+1 in Tandem's [-1, 1] is +3 N for InvertedPendulum-v5: same trajectory as the raw env."""
    ours = make_inverted_pendulum_env(seed=3)
    raw = gym.make("InvertedPendulum-v5")
    o1, _ = ours.reset()
    o2, _ = raw.reset(seed=3)
    np.testing.assert_allclose(o1[OBS_STATE], o2.astype(np.float32))
    for u in (1.0, 0.5, -1.0):
        o1, r1, t1, _, _ = ours.step(np.array([u], np.float32))
        o2, r2, t2, _, _ = raw.step(np.array([3.0 * u], np.float32))
        np.testing.assert_allclose(o1[OBS_STATE], o2.astype(np.float32), rtol=1e-5, atol=1e-6)
        assert (r1, t1) == (float(r2), t2)


def test_pendulum_falling_terminates_and_surviving_truncates_with_success():
    env = make_inverted_pendulum_env(seed=0)
    env.reset()
    for _ in range(100):  # full push one way: the pole falls well before the limit
        _, _, terminated, truncated, info = env.step(np.ones(1, np.float32))
        if terminated or truncated:
            break
    assert terminated and not truncated and not info["is_success"]
    short = make_inverted_pendulum_env(max_episode_steps=5, seed=0)
    short.reset()
    for t in range(5):
        _, _, terminated, truncated, info = short.step(np.zeros(1, np.float32))
        assert not terminated and info["is_success"] == (t == 4)
    assert truncated


# -- learning ---------------------------------------------------------------------------------
def _act(policy: MLPPolicy, obs: dict, deterministic: bool) -> np.ndarray:
    with torch.no_grad():
        chunk = policy.act({OBS_STATE: torch.from_numpy(obs[OBS_STATE])[None]},
                           deterministic=deterministic)
    return chunk.actions[0, 0].numpy()


def _evaluate(env: gym.Env, choose, episodes: int, seed0: int) -> tuple[float, float]:
    """(success rate, mean episode length) over ``episodes`` episodes."""
    ok, lengths = [], []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed0 + i)
        n = 0
        while True:
            obs, _, terminated, truncated, info = env.step(choose(obs))
            n += 1
            if terminated or truncated:
                break
        ok.append(info["is_success"])
        lengths.append(n)
    return float(np.mean(ok)), float(np.mean(lengths))


# Tuned on tandem/InvertedPendulum-v0 with one CPU thread (see the SAC report).
PENDULUM_POLICY = MLPPolicyConfig(hidden_dims=(64, 64))
PENDULUM_SAC = SACConfig(gamma=0.99, tau=0.05, actor_lr=1e-3, critic_lr=1e-3, temp_lr=1e-3,
                         batch_size=128, utd_ratio=2, init_temperature=0.1,
                         critic_hidden_dims=(64, 64))


def train_sac(env: gym.Env, eval_env: gym.Env, *, sac: SACConfig, pcfg: MLPPolicyConfig,
              learning_starts: int, max_env_steps: int, max_seconds: float,
              eval_every_episodes: int = 5, eval_episodes: int = 10,
              stop_success: float = 0.8, seed: int = 0) -> tuple[MLPPolicy, dict]:
    """In-process actor/learner loop; stops once a deterministic evaluation reaches
    ``stop_success`` or a budget runs out. Returns the policy and counters."""
    torch.manual_seed(seed)
    spec = spec_from_env(env)
    policy = MLPPolicy(pcfg, spec)
    agent = SACAgent(sac, policy, spec, Accelerator(cpu=True))
    replay = ReplayBuffer(2 * max_env_steps, spec, seed=seed)

    def batches():
        while True:
            yield replay.sample(sac.batch_size)

    it = batches()
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    episode, step, updates, t = 0, 0, 0, 0
    t0 = time.perf_counter()
    solved_at = None
    last_eval = 0.0

    def record(o, action, reward, terminated, truncated, is_last, success):
        return {OBS_STATE: o[OBS_STATE], "action": action, "reward": reward,
                "terminated": terminated, "truncated": truncated, "intervened": False,
                "is_last": is_last, "success": success, "policy_version": updates,
                "episode": episode, "step": step, "task": ""}

    for t in range(1, max_env_steps + 1):
        action = (env.action_space.sample() if t <= learning_starts
                  else _act(policy, obs, deterministic=False))
        nobs, reward, terminated, truncated, info = env.step(action)
        recs = [record(obs, action, reward, terminated, truncated, False, info["is_success"])]
        step += 1
        if terminated or truncated:
            recs.append(record(nobs, np.zeros_like(action), 0.0, False, False, True,
                               info["is_success"]))
        replay.add(TransitionBatch.from_records("actor-0", t, recs))
        obs = nobs
        if t >= learning_starts:
            agent.update(it)
            updates += 1
        if terminated or truncated:
            episode += 1
            step = 0
            obs, _ = env.reset()
            if t >= learning_starts and episode % eval_every_episodes == 0:
                last_eval, _ = _evaluate(eval_env, lambda o: _act(policy, o, True),
                                         eval_episodes, seed0=10_000 + episode * eval_episodes)
                if last_eval >= stop_success:
                    solved_at = t
                    break
            if time.perf_counter() - t0 > max_seconds:
                break
    return policy, {"env_steps": t, "updates": updates, "episodes": episode,
                    "seconds": time.perf_counter() - t0, "solved_at": solved_at,
                    "last_eval": last_eval}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sac_learns_to_balance_the_pendulum():
    torch.set_num_threads(1)
    env = make_inverted_pendulum_env()
    eval_env = make_inverted_pendulum_env()
    eval_env.action_space.seed(123)
    rand_success, rand_len = _evaluate(eval_env, lambda o: eval_env.action_space.sample(), 20,
                                       seed0=50_000)
    policy, stats = train_sac(env, eval_env, sac=PENDULUM_SAC, pcfg=PENDULUM_POLICY,
                              learning_starts=250, max_env_steps=6000, max_seconds=150)
    success, length = _evaluate(eval_env, lambda o: _act(policy, o, True), 20, seed0=50_000)
    print(f"\nrandom: success {rand_success:.2f}, length {rand_len:.1f}; trained: success "
          f"{success:.2f}, length {length:.1f}; {stats}")
    # a random policy falls within a few steps and never lasts the 100 steps
    assert rand_success <= 0.1 and rand_len < 20
    # the trained one balances: most episodes reach the time limit
    assert length >= rand_len + 50, stats
    assert success >= rand_success + 0.5, stats
