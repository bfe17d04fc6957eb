"""Real LIBERO tasks from all five suites: offline set-up, init states, stepping, rendering,
image orientation and success detection (by forcing a goal state).

Uses ../shared/libero-assets.tar.xz (or $TANDEM_LIBERO_ASSETS_TARBALL), extracted once into
the cache; skipped when neither it nor another LIBERO assets folder exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from envs import libero as L
from envs.libero import assets as A
from envs.registry import make_env
from envs.spec import spec_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assets_available() -> bool:
    try:
        L.resolve_assets()
        return True
    except FileNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _assets_available(), reason="no LIBERO assets (see envs/libero/assets.py)")

# one task per suite whose goal force_goal_state can satisfy: an On, an In, an Open, a
# Turnon + On, and a Turnon
CASES = [("libero_spatial", 0), ("libero_object", 0), ("libero_goal", 0), ("libero_10", 2), ("libero_90", 20)]


def test_suites_tasks_and_limits_without_building_a_sim():
    counts = {s: len(L.list_tasks(s)) for s in L.SUITES}
    assert counts == {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10,
                      "libero_90": 90}
    for suite, steps in L.SUITE_MAX_STEPS.items():
        env = make_env({"name": suite, "task_id": 1, "image_size": 96})
        spec = spec_from_env(env)  # spaces only: the simulator is built on first reset
        assert env.unwrapped._env is None
        assert spec.max_episode_steps == steps
        assert spec.state_dim == 8 and spec.action_dim == 7 and spec.has_task
        assert spec.cameras == {"image": (96, 96, 3), "wrist_image": (96, 96, 3)}
        env.close()
    t = L.list_tasks("libero_90")[0]
    assert t.language == "close the top drawer of the cabinet"  # LIBERO's filename rule
    with pytest.raises(ValueError, match="unknown LIBERO suite"):
        L.list_tasks("libero_100")


def test_init_states_load_without_torch_like_torch_does():
    torch = pytest.importorskip("torch")
    task = L.list_tasks("libero_goal")[3]
    ours = L.load_init_states(task.init_states_file)
    ref = torch.load(task.init_states_file, weights_only=False)
    assert ours.dtype == np.float64 and ours.shape == ref.shape and np.array_equal(ours, ref)


def test_assets_tarball_extracted_once_keyed_by_sha(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "assets"
    for d in L.ASSET_SUBDIRS:
        (src / d).mkdir(parents=True)
        (src / d / "x.txt").write_text(d)
    tar = tmp_path / "a.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(src, arcname=".")
    first = L.extract_assets_tarball(tar)
    sha = A._file_sha256(tar)
    assert first == tmp_path / "cache" / "libero-assets" / sha
    assert (first / "scenes" / "x.txt").read_text() == "scenes"
    mtime = (first / ".tandem-complete").stat().st_mtime_ns
    assert L.extract_assets_tarball(tar) == first
    assert (first / ".tandem-complete").stat().st_mtime_ns == mtime  # not extracted again
    assert L.resolve_assets(assets_tarball=str(tar)) == first
    assert L.resolve_assets(assets_path=str(first)) == first
    with pytest.raises(FileNotFoundError, match="not a LIBERO assets folder"):
        L.resolve_assets(assets_path=str(tmp_path))


def test_first_import_neither_prompts_nor_downloads(tmp_path):
    """A fresh process with no LIBERO config and stdin closed builds and renders an env."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIBERO_CONFIG_PATH", "MUJOCO_GL",
                                                           "PYOPENGL_PLATFORM")}
    env.update(HF_HUB_OFFLINE="1", HOME=str(tmp_path))  # no ~/.libero, no ~/.cache/libero
    env["TANDEM_CACHE_DIR"] = str(L.cache_root())       # reuse the extracted assets
    code = (
        "from envs.libero import LiberoEnv; import os, libero.libero as LL;"
        "e = LiberoEnv('libero_goal', 0, image_size=32, num_steps_wait=0); o, _ = e.reset();"
        "print('OK', o['observation.images.image'].shape, os.environ['MUJOCO_GL'], LL.get_assets_path())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("OK")][0]
    assert "(32, 32, 3)" in line and str(L.cache_root()) in line
    assert "Downloading" not in out.stdout + out.stderr
    assert not (tmp_path / ".libero").exists()  # LIBERO's default config dir was not used


@pytest.mark.parametrize("suite,task_id", CASES)
def test_real_task_reset_step_render_success(suite, task_id):
    env = make_env({"name": suite, "task_id": task_id, "init_state_id": None, "image_size": 64})
    base = env.unwrapped
    try:
        obs, info = env.reset(seed=3)
        assert info["init_state"] == 3 and info["task_id"] == task_id and not info["is_success"]
        assert env.observation_space.contains(obs)
        assert obs[OBS_STATE].shape == (8,) and obs[OBS_STATE].dtype == np.float32
        assert obs[TASK] == base.task.language and obs[TASK]
        for key in ("image", "wrist_image"):
            img = obs[OBS_IMAGE_PREFIX + key]
            assert img.shape == (64, 64, 3) and img.dtype == np.uint8 and img.std() > 5
        # images are the simulator's rotated by 180 degrees (OpenVLA-OFT's get_libero_image)
        raw = base._env.env._get_observations()
        assert np.array_equal(obs[OBS_IMAGE_PREFIX + "image"], raw["agentview_image"][::-1, ::-1])
        assert np.array_equal(obs[OBS_IMAGE_PREFIX + "wrist_image"], raw["robot0_eye_in_hand_image"][::-1, ::-1])
        # the state is eef pos + axis-angle + gripper qpos
        assert np.allclose(obs[OBS_STATE][:3], raw["robot0_eef_pos"], atol=1e-6)
        assert np.allclose(obs[OBS_STATE][6:], raw["robot0_gripper_qpos"], atol=1e-6)
        first = obs[OBS_IMAGE_PREFIX + "wrist_image"]
        for _ in range(3):
            obs, r, term, trunc, info = env.step(np.array([0.0, 0.0, 0.6, 0.0, 0.0, 0.0, -1.0], np.float32))
            assert (r, term, trunc) == (0.0, False, False) and info["is_success"] is False
        assert not np.array_equal(first, obs[OBS_IMAGE_PREFIX + "wrist_image"])  # the arm moved
        frame = env.render()
        assert frame.shape == (64, 128, 3)
        # success: force the goal predicates, then the next step pays 1 and terminates
        assert L.force_goal_state(base)
        obs, r, term, trunc, info = env.step(np.array([0, 0, 0, 0, 0, 0, -1], np.float32))
        assert (r, term, trunc) == (1.0, True, False) and info["is_success"] is True
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step(np.zeros(7, np.float32))
    finally:
        env.close()


def test_init_state_is_restored_exactly_and_layouts_are_seeded():
    env = L.LiberoEnv("libero_object", 4, init_state_id=7, image_size=32, num_steps_wait=0)
    try:
        env.reset(seed=0)
        state = env.sim.get_state().flatten()
        init = env.init_states[7]
        assert np.allclose(state[: len(init)], init)
        a, _ = env.reset(seed=11)
        b, _ = env.reset(seed=11)
        assert np.array_equal(a[OBS_IMAGE_PREFIX + "image"], b[OBS_IMAGE_PREFIX + "image"])
        c, info = env.reset(options={"init_state": 2})
        assert info["init_state"] == 2
    finally:
        env.close()


def test_multi_task_env_walks_tasks_and_runs_jobs_exactly():
    env = L.LiberoEnv("libero_goal", [0, 1], init_state_id=None, image_size=32, num_steps_wait=0)
    try:
        langs = []
        for seed in (2, 1):  # episode k: task k mod 2, init state k div 2
            obs, info = env.reset(seed=seed)
            langs.append(obs[TASK])
            assert info["task_id"] == seed % 2 and info["init_state"] == seed // 2
        assert langs[0] == L.list_tasks("libero_goal")[0].language != langs[1]
        # a learner's job: exactly that task and init state, whatever the seed says
        job = {"task_id": 1, "init_state": 4}
        obs, info = env.reset(seed=0, options=job)
        assert (info["task_id"], info["init_state"]) == (1, 4) and obs[TASK] == langs[1]
        init = env.init_states[4]
        assert np.array_equal(env.init_states, L.load_init_states(L.list_tasks("libero_goal")[1].init_states_file))
        assert np.allclose(env.sim.get_state().flatten()[: len(init)], init)
        again, _ = env.reset(seed=0, options=job)
        assert np.array_equal(obs[OBS_STATE], again[OBS_STATE])
        # bad jobs are refused before the env changes: it still steps in its episode
        for bad, msg in [({"task_id": 10}, r"out of range: libero_goal has tasks 0\.\.9"),
                         ({"task_id": 5}, r"not one of this env's tasks \[0, 1\]"),
                         ({"task_id": 0, "init_state": 50}, r"init states 0\.\.49"),
                         ({"init_state": -1}, "must be an int >= 0"),
                         ({"init_state_id": 1}, "unknown reset options")]:
            with pytest.raises(ValueError, match=msg):
                env.reset(options=bad)
        assert env.task.task_id == 1
        env.step(np.zeros(7, np.float32))
    finally:
        env.close()
    assert len(L.LiberoEnv("libero_10", "all").tasks) == 10
