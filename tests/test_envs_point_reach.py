"""``point_reach`` (envs/point_reach.py): the pure-numpy image + instruction task. Its static
spec equals the built env's; the image shows the target; reset options are exact; the
scripted expert always succeeds and random actions mostly fail; success terminates and the
time limit truncates, never both; and it runs at thousands of steps/s."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.spec import EnvSpec
from envs.point_reach import PALETTE, PointReachEnv, expert_action, instruction, rates
from envs.registry import env_spec, make_env
from envs.spec import spec_from_env

ROOT = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((ROOT / "config" / "env" / "point_reach.yaml").read_text())
IMG = OBS_IMAGE_PREFIX + "image"
HARD = {"randomize_targets": True, "cameras": ["image", "wrist"]}


def _env(**over):
    return make_env({**BASE, **over})


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if k == TASK else np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("over", [
    {},
    {"image_size": [24, 40], "cameras": {"front": "top", "wrist": "wrist"},
     "max_episode_steps": 12},
    {"state_has_target": True, "action_dim": 7, "cameras": {}},
    {"render_size": 64, "image_size": 16, "crop": [0.25, 0.25, 0.5, 0.5]},
], ids=["default", "two_cams", "state_only", "render_crop"])
def test_static_spec_equals_the_built_env(over):
    cfg = {**BASE, **over}
    env = make_env(cfg)
    try:
        assert env_spec(cfg) == spec_from_env(env)
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
    finally:
        env.close()
    assert env_spec(BASE) == EnvSpec(state_dim=2, action_dim=2, cameras={"image": (32, 32, 3)},
                                     has_task=True, max_episode_steps=30)


def test_bad_configs_are_clear_errors():
    for over, msg in [({"num_tasks": 9}, "num_tasks must be 1..8"),
                      ({"task_id": 4}, "has tasks 0..3"), ({"task_id": "some"}, "or 'all'"),
                      ({"cameras": {"c": "side"}}, "camera views are"),
                      ({"action_dim": 1}, "action_dim must be >= 2"),
                      ({"max_speed": 0}, "max_speed must be > 0")]:
        with pytest.raises(ValueError, match=msg):
            env_spec({**BASE, **over})


def test_the_image_shows_the_target_and_the_instruction_names_it():
    # one target drawn: the image differs per task, with the task's colour at its target
    env = PointReachEnv({"distractors": False})
    imgs = []
    for t in range(4):
        obs, info = env.reset(options={"task_id": t, "init_state": 3})
        assert info["task_id"] == t
        assert obs[TASK] == instruction(t) == f"reach the {PALETTE[t][0]} target"
        h, w = obs[IMG].shape[:2]
        tx, ty = env.target
        px = obs[IMG][int((1 - ty) * h), int(tx * w)]
        assert tuple(px) == PALETTE[t][1]
        assert np.isin(obs[IMG].reshape(-1, 3), np.array([(255, 255, 255)])).all(1).any()  # agent
        imgs.append(obs[IMG])
    assert all(not np.array_equal(imgs[i], imgs[j]) for i in range(4) for j in range(i))
    # distractors (default): every target is drawn, so only the instruction tells the tasks apart
    env = PointReachEnv({})
    firsts = [env.reset(options={"task_id": t, "init_state": 3})[0] for t in range(4)]
    assert all(np.array_equal(f[IMG], firsts[0][IMG]) for f in firsts)
    assert all(np.array_equal(f[OBS_STATE], firsts[0][OBS_STATE]) for f in firsts)
    assert len({f[TASK] for f in firsts}) == 4
    colours = {tuple(c) for c in firsts[0][IMG].reshape(-1, 3)}
    assert {rgb for _, rgb in PALETTE[:4]} <= colours
    # randomized targets: the layout (so the image) changes with the initial state
    env = PointReachEnv({"randomize_targets": True})
    a = env.reset(options={"task_id": 0, "init_state": 1})[0]
    b = env.reset(options={"task_id": 0, "init_state": 2})[0]
    assert not np.array_equal(a[IMG], b[IMG])


def test_wrist_view_follows_the_agent():
    env = PointReachEnv({"cameras": {"top": "top", "wrist": "wrist"}, "image_size": 33})
    obs, _ = env.reset(options={"task_id": 0, "init_state": 0})
    wrist = obs[OBS_IMAGE_PREFIX + "wrist"]
    assert tuple(wrist[16, 16]) == (255, 255, 255)   # the agent sits in the middle
    for _ in range(30):                              # push into the corner: outside shows grey
        obs, *_ = env.step(np.array([-1.0, -1.0], np.float32))
    wrist = obs[OBS_IMAGE_PREFIX + "wrist"]
    assert tuple(wrist[-1, 0]) == (96, 96, 96) and tuple(wrist[16, 16]) == (255, 255, 255)


def test_reset_options_are_exact():
    env = _env(**HARD)
    try:
        a, info = env.reset(seed=123, options={"task_id": 2, "init_state": 7})
        assert (info["task_id"], info["init_state"], info["is_success"]) == (2, 7, False)
        b, _ = env.reset(seed=5, options={"task_id": 2, "init_state": 7})
        c, _ = env.reset(options={"task_id": 2, "init_state": 7})
        d, _ = env.reset(seed=123, options={"task_id": 2, "init_state": 8})
        assert _same(a, b) and _same(a, c) and not _same(a, d)
        # init_state alone also fixes the task
        e, info_e = env.reset(seed=1, options={"init_state": 9})
        f, info_f = env.reset(seed=2, options={"init_state": 9})
        assert _same(e, f) and info_e["task_id"] == info_f["task_id"]
        # without a job the seed decides, and a job's reset leaves that RNG stream alone
        s1, info = env.reset(seed=3)
        assert info["init_state"] is None
        first, _ = env.reset()
        env.reset(seed=3)
        env.reset(options={"task_id": 1, "init_state": 7})
        after_job, _ = env.reset()
        assert _same(first, after_job)
        assert _same(s1, env.reset(seed=3)[0])
        with pytest.raises(ValueError, match="task_id 4 is out of range"):
            env.reset(options={"task_id": 4, "init_state": 0})
        with pytest.raises(ValueError, match="unknown reset options"):
            env.reset(options={"init_state_id": 0})
        with pytest.raises(ValueError, match="must be an int >= 0"):
            env.reset(options={"init_state": -1})
    finally:
        env.close()
    env = _env(task_id=[1, 3])
    tasks = {env.reset(seed=s)[1]["task_id"] for s in range(40)}
    assert tasks == {1, 3}
    with pytest.raises(ValueError, match=r"not one of this env's tasks \[1, 3\]"):
        env.reset(options={"task_id": 0})


@pytest.mark.parametrize("over", [{}, HARD, {"num_tasks": 8, "action_dim": 4}],
                         ids=["default", "hard", "8tasks"])
def test_expert_always_succeeds_and_random_mostly_fails(over):
    env = _env(**over)
    n_tasks = over.get("num_tasks", 4)
    for t in range(n_tasks):
        for i in range(10):
            obs, _ = env.reset(options={"task_id": t, "init_state": i})
            for k in range(31):
                a = expert_action(obs, env) if k % 2 else expert_action(env)   # both forms
                assert a.shape == (env.action_space.shape[0],) and env.action_space.contains(a)
                obs, reward, term, trunc, info = env.step(a)
                if term or trunc:
                    break
            assert term and not trunc and reward == 1.0 and info["is_success"], (t, i, k)
    env.close()
    expert = rates(over, 100)
    rnd = rates(over, 300, policy="random")
    print(f"\npoint_reach {over}: expert success {expert:.3f}, random success {rnd:.3f}")
    assert expert == 1.0 and rnd < 0.3


def test_terminated_and_truncated_are_kept_apart():
    env = _env(max_episode_steps=10)
    env.reset(options={"task_id": 0, "init_state": 0})
    for k in range(10):   # standing still never reaches the target
        _, reward, term, trunc, info = env.step(np.zeros(2, np.float32))
        assert reward == 0.0 and not term and trunc == (k == 9) and not info["is_success"]
    env.reset(options={"task_id": 0, "init_state": 0})
    while True:
        _, reward, term, trunc, info = env.step(expert_action(env))
        if term or trunc:
            break
    assert term and not trunc and reward == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.unwrapped.step(np.zeros(2, np.float32))
    # dense reward: minus the distance until success, then 1
    env = _env(dense_reward=True)
    _, info = env.reset(options={"task_id": 1, "init_state": 0})
    d0 = info["distance"]
    _, reward, term, _, info = env.step(expert_action(env))
    assert not term and reward == pytest.approx(-info["distance"]) and info["distance"] < d0
    # the state holds the target only when asked to
    env = _env(state_has_target=True, cameras={})
    obs, _ = env.reset(options={"task_id": 2, "init_state": 0})
    assert obs[OBS_STATE].shape == (4,) and np.allclose(obs[OBS_STATE][2:], env.unwrapped.target)
    assert set(obs) == {OBS_STATE, TASK}


def test_speed():
    out = []
    for over in ({}, HARD):
        env = _env(**over)
        env.reset(seed=0)
        acts = np.random.default_rng(0).uniform(-1, 1, (3000, 2)).astype(np.float32)
        t0 = time.perf_counter()
        for a in acts:
            _, _, term, trunc, _ = env.step(a)
            if term or trunc:
                env.reset()
        sps = len(acts) / (time.perf_counter() - t0)
        out.append(sps)
        print(f"\npoint_reach {over}: {sps:.0f} steps/s (make_env, random actions, "
              f"resets included)")
    assert min(out) > 1000   # typically 10-30k; loose for a loaded machine
