"""``env=point_reach_vl`` (config/env/point_reach_vl.yaml): the point_reach setting where seeing
and reading are both needed. Both targets are drawn in every image, at layouts that change per
episode; the instruction alone says which one counts (walking to the other never succeeds);
the state carries no target; no policy can succeed in fewer than 8 steps; resets are seeded."""

from __future__ import annotations

import numpy as np
import pytest

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs.point_reach import PALETTE, PointReachEnv, expert_action, instruction, rates
from envs.registry import make_env
from tools.record_demos import env_config

IMG = OBS_IMAGE_PREFIX + "image"


@pytest.fixture(scope="module")
def cfg():
    return dict(env_config(["env=point_reach_vl"]))


def _pixel(img: np.ndarray, xy: np.ndarray) -> tuple[int, ...]:
    h, w = img.shape[:2]
    return tuple(int(v) for v in img[min(int((1 - xy[1]) * h), h - 1), min(int(xy[0] * w), w - 1)])


def test_the_setting_is_what_its_config_says(cfg):
    env = make_env(cfg)
    obs, _ = env.reset(seed=0)
    u = env.unwrapped
    assert u.cfg.num_tasks == 2 and not u.cfg.state_has_target and u.cfg.distractors
    assert obs[OBS_STATE].shape == (2,) and np.allclose(obs[OBS_STATE], u.pos)   # no target in the state
    assert set(obs) == {OBS_STATE, IMG, TASK}
    assert {instruction(0), instruction(1)} == {"reach the red target", "reach the green target"}


def test_both_targets_are_drawn_and_the_layout_changes_per_episode(cfg):
    env = make_env(cfg)
    layouts = set()
    for seed in range(60):
        obs, info = env.reset(seed=seed)
        u = env.unwrapped
        for t in range(2):   # each task's target is drawn in its colour at its place
            assert _pixel(obs[IMG], u.targets[t]) == PALETTE[t][1], (seed, t)
        assert _pixel(obs[IMG], u.pos) == (255, 255, 255)
        assert obs[TASK] == instruction(info["task_id"])
        layouts.add(tuple(np.round(u.targets, 6).ravel()))
    assert len(layouts) == 12   # 4 slots, 2 distinct ones per episode: 4 * 3 ordered layouts
    assert {env.reset(seed=s)[1]["task_id"] for s in range(20)} == {0, 1}


def test_the_instruction_alone_decides_which_target_succeeds(cfg):
    env = PointReachEnv(cfg)
    for i in range(20):
        for task in (0, 1):
            obs, _ = env.reset(options={"task_id": task, "init_state": i})
            other = env.targets[1 - task].copy()
            # same image and state for both tasks: only the instruction differs
            twin, _ = PointReachEnv(cfg).reset(options={"task_id": 1 - task, "init_state": i})
            assert np.array_equal(obs[IMG], twin[IMG]) and np.array_equal(obs[OBS_STATE], twin[OBS_STATE])
            assert obs[TASK] != twin[TASK]
            # walking straight to the other target and staying there never succeeds
            for _ in range(cfg["max_episode_steps"]):
                d = (other - env.pos) / env.cfg.max_speed
                obs, reward, term, trunc, info = env.step(d / max(1.0, float(np.linalg.norm(d))))
                assert not term and reward == 0.0 and not info["is_success"]
            assert np.linalg.norm(env.pos - other) < 1e-6
            # the expert, which walks to the instructed target, always does
            obs, _ = env.reset(options={"task_id": task, "init_state": i})
            for k in range(cfg["max_episode_steps"]):
                obs, reward, term, trunc, info = env.step(expert_action(env))
                if term:
                    break
            assert term and info["is_success"] and reward == 1.0 and k + 1 >= 8


def test_no_episode_can_be_solved_in_fewer_than_8_steps(cfg):
    env = PointReachEnv(cfg)
    c = env.cfg
    fewest = (c.start_distance - c.success_radius) / c.max_speed
    assert fewest >= 8
    for seed in range(300):
        env.reset(seed=seed)
        assert min(np.linalg.norm(env.pos - t) for t in env.targets) >= c.start_distance
    # random actions essentially never succeed
    assert rates(cfg, 300, policy="random") <= 0.02


def test_seeded_resets_are_deterministic(cfg):
    a, b = make_env(cfg), make_env(cfg)
    for seed in (0, 7, 123):
        oa, ia = a.reset(seed=seed)
        ob, ib = b.reset(seed=seed)
        assert ia["task_id"] == ib["task_id"] and oa[TASK] == ob[TASK]
        assert np.array_equal(oa[IMG], ob[IMG]) and np.array_equal(oa[OBS_STATE], ob[OBS_STATE])
        acts = np.random.default_rng(seed).uniform(-1, 1, (10, 2)).astype(np.float32)
        for act in acts:
            ra, rb = a.step(act), b.step(act)
            assert np.array_equal(ra[0][IMG], rb[0][IMG]) and ra[1:4] == rb[1:4]
    firsts = [a.reset(seed=s)[0][OBS_STATE] for s in range(5)]
    assert len({tuple(f) for f in firsts}) == 5   # other seeds, other starts


def test_new_options_are_checked():
    for over, msg in [({"target_slots": 1, "num_tasks": 2}, "target_slots must be"),
                      ({"target_slots": 4, "randomize_targets": True}, "exclude each other"),
                      ({"start_distance": 0.0}, "start_distance must be")]:
        with pytest.raises(ValueError, match=msg):
            PointReachEnv(over)
    # start_distance with free targets: the start is drawn first, the targets around it
    env = PointReachEnv({"randomize_targets": True, "start_distance": 0.45, "num_tasks": 3})
    for seed in range(100):
        env.reset(seed=seed)
        assert min(np.linalg.norm(env.pos - t) for t in env.targets) >= 0.45
