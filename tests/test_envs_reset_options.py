"""Learner-driven episodes on the single-task MuJoCo envs (pendulum, reacher): a job's
``reset(seed, options={"task_id": 0, "init_state": i})`` gives a first observation that
depends on ``init_state`` only; other task ids and unknown options are refused. (LIBERO and
gym-hil: tests/test_envs_libero.py, tests/test_envs_gym_hil.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from data.core.jobs import Job
from data.core.schema import OBS_STATE
from envs.registry import make_env
from envs.reset_options import check_reset_options, init_state_seed

pytest.importorskip("mujoco")


@pytest.mark.parametrize("name", ["inverted_pendulum", "reacher"])
def test_init_state_fixes_the_first_observation_whatever_the_seed(name):
    env = make_env({"name": name})
    try:
        job = Job(job_id=1, task_id=0, init_state=7, seed=123)
        a, info = env.reset(seed=job.seed, options=job.reset_options())
        assert (info["task_id"], info["init_state"]) == (0, 7) and isinstance(info["is_success"], bool)
        b, _ = env.reset(seed=5, options={"task_id": 0, "init_state": 7})
        c, _ = env.reset(options={"init_state": 7})
        d, _ = env.reset(seed=123, options={"init_state": 8})
        assert np.array_equal(a[OBS_STATE], b[OBS_STATE]) and np.array_equal(a[OBS_STATE], c[OBS_STATE])
        assert not np.array_equal(a[OBS_STATE], d[OBS_STATE])
        # without a job the seed decides, and a job's reset leaves that RNG stream alone
        _, info = env.reset(seed=3)
        assert (info["task_id"], info["init_state"]) == (0, None)
        first, _ = env.reset()
        env.reset(seed=3)
        env.reset(options={"init_state": 7})
        after_job, _ = env.reset()
        assert np.array_equal(first[OBS_STATE], after_job[OBS_STATE])
        # an episode after a job reset runs as usual
        _, _, terminated, truncated, info = env.step(np.zeros(env.action_space.shape, np.float32))
        assert isinstance(info["is_success"], bool)
        with pytest.raises(ValueError, match=f"{name} has one task: task_id must be 0, got 1"):
            env.reset(options={"task_id": 1, "init_state": 0})
        with pytest.raises(ValueError, match="unknown reset options"):
            env.reset(options={"init_state_id": 0})
    finally:
        env.close()


def test_option_values_are_checked():
    assert check_reset_options(None, "x") == {"task_id": None, "init_state": None}
    assert check_reset_options({"task_id": np.int64(2)}, "x") == {"task_id": 2, "init_state": None}
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            check_reset_options({"init_state": bad}, "x")
    seeds = {init_state_seed(i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert init_state_seed(5) == init_state_seed(5) != 5
