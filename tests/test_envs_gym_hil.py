"""gym-hil Panda tasks, headless, in the common schema: a scripted pick-up episode that
succeeds, time-limit truncation, seeding, and the state-only mode."""

from __future__ import annotations

import numpy as np
import pytest

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.gym_hil import canonical_task
from envs.registry import make_env
from envs.spec import spec_from_env


def scripted_pick(obs, phase: dict) -> np.ndarray:
    """Above the cube, down, close, lift (needs include_env_state: cube pos at state[18:21])."""
    s = obs[OBS_STATE]
    tcp, cube = s[15:18], s[18:21]
    a = np.zeros(4, np.float32)
    if phase["p"] == 0:
        tgt = cube + [0, 0, 0.06]
        a[:3], a[3] = np.clip((tgt - tcp) / 0.025, -1, 1), -1
        phase["p"] += np.linalg.norm(tgt - tcp) < 0.01
    elif phase["p"] == 1:
        a[:3], a[3] = np.clip((cube - tcp) / 0.025, -1, 1), -1
        if np.linalg.norm(cube - tcp) < 0.008:
            phase["p"], phase["k"] = 2, 0
    elif phase["p"] == 2:
        a[3] = 1
        phase["k"] += 1
        phase["p"] += phase["k"] > 6
    else:
        a[2], a[3] = 1, 1
    return a


def test_pick_cube_episode_with_images_succeeds():
    env = make_env({"name": "gym_hil", "task": "gym_hil/PandaPickCubeBase-v0", "image_size": 48,
                    "include_env_state": True})
    try:
        spec = spec_from_env(env)
        assert spec.state_dim == 21 and spec.action_dim == 4 and spec.max_episode_steps == 100
        assert spec.cameras == {"front": (48, 48, 3), "wrist": (48, 48, 3)} and spec.has_task
        obs, info = env.reset(seed=0)
        assert env.observation_space.contains(obs) and obs[TASK] == "pick up the cube"
        assert obs[OBS_IMAGE_PREFIX + "front"].std() > 5
        phase, rewards = {"p": 0, "k": 0}, []
        for t in range(100):
            obs, r, term, trunc, info = env.step(scripted_pick(obs, phase))
            rewards.append(r)
            if term or trunc:
                break
        assert term and not trunc and info["is_success"] and rewards[-1] == 1.0 and sum(rewards) == 1.0
        assert t < 60
        assert env.render().shape == (48, 96, 3)
    finally:
        env.close()


def test_time_limit_truncates_and_seeding_reproduces():
    env = make_env({"name": "gym_hil", "task": "PandaPickCube", "cameras": {}, "max_episode_steps": 5})
    try:
        assert OBS_IMAGE_PREFIX + "front" not in env.observation_space.spaces
        a, _ = env.reset(seed=4)
        b, _ = env.reset(seed=4)
        c, _ = env.reset(seed=5)
        assert np.array_equal(a[OBS_STATE], b[OBS_STATE])
        assert not np.array_equal(a[OBS_STATE][18:], c[OBS_STATE][18:])  # cube moved
        flags = []
        for _ in range(5):
            _, _, term, trunc, _ = env.step(np.zeros(4, np.float32))
            flags.append((term, trunc))
        assert flags == [(False, False)] * 4 + [(False, True)]
    finally:
        env.close()


def test_arrange_boxes_and_task_names():
    env = make_env({"name": "gym_hil", "task": "PandaArrangeBoxes", "image_size": 32})
    try:
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
        obs, r, term, trunc, info = env.step(env.action_space.sample())
        assert r == 0.0 and "is_success" in info
    finally:
        env.close()
    assert canonical_task("gym_hil/PandaPickCubeKeyboard-v0") == "PandaPickCube"
    with pytest.raises(ValueError, match="unknown gym-hil task"):
        canonical_task("PandaStackCubes")


def test_job_reset_options_pick_a_deterministic_placement():
    env = make_env({"name": "gym_hil", "task": "PandaPickCube", "cameras": {}})
    try:
        a, info = env.reset(seed=1, options={"task_id": 0, "init_state": 3})
        assert (info["task_id"], info["init_state"]) == (0, 3)
        b, _ = env.reset(seed=99, options={"task_id": 0, "init_state": 3})
        c, _ = env.reset(seed=1, options={"init_state": 4})
        assert np.array_equal(a[OBS_STATE], b[OBS_STATE])  # the seed does not move the cube
        assert not np.array_equal(a[OBS_STATE][18:], c[OBS_STATE][18:])
        _, info = env.reset(seed=1)
        assert (info["task_id"], info["init_state"]) == (0, None)
        # a job's reset leaves the env's own RNG stream as it was
        env.reset(seed=4)
        plain, _ = env.reset()
        env.reset(seed=4)
        env.reset(options={"init_state": 3})
        after_job, _ = env.reset()
        assert np.array_equal(plain[OBS_STATE], after_job[OBS_STATE])
        with pytest.raises(ValueError, match="one task: task_id must be 0"):
            env.reset(options={"task_id": 1})
        with pytest.raises(ValueError, match="unknown reset options"):
            env.reset(options={"init_state_id": 1})
    finally:
        env.close()


def test_dense_reward_shapes_the_pick_and_success_still_terminates():
    """``reward_type: dense`` passes gym-hil's reach + lift reward through (state only, the
    cube at its fixed start, as compare_lerobot's pick_cube_state); sparse stays the default."""
    env = make_env({"name": "gym_hil", "task": "PandaPickCube", "cameras": {}, "include_env_state": True,
                    "reward_type": "dense", "random_block_position": False})
    try:
        obs, _ = env.reset(seed=0)
        phase, rewards = {"p": 0, "k": 0}, []
        for _ in range(100):
            obs, r, term, trunc, info = env.step(scripted_pick(obs, phase))
            rewards.append(r)
            if term or trunc:
                break
        assert term and not trunc and info["is_success"]
        assert 0.0 < rewards[0] < 0.3 and max(rewards[:-1]) < rewards[-1] <= 1.0  # reach, then lift
        assert rewards[-1] > 0.7
    finally:
        env.close()
    with pytest.raises(ValueError, match="sparse or dense"):
        make_env({"name": "gym_hil", "task": "PandaPickCube", "cameras": {}, "reward_type": "shaped"})
    with pytest.raises(ValueError, match="PandaPickCube only"):
        make_env({"name": "gym_hil", "task": "PandaArrangeBoxes", "cameras": {}, "reward_type": "dense"})
