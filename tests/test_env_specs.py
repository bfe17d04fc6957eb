"""``envs.registry.env_spec(cfg)``: the spec a learner computes from an env config without a
simulator equals the one an actor reads off the env it builds (``spec_from_env(make_env(cfg))``)
for every config in config/env/, with the wrappers' effect (image size, crop, time limit);
and computing it imports no simulator at all."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data.core.spec import EnvSpec
from envs import registry
from envs.registry import env_spec, make_env
from envs.spec import spec_from_env
from tandem_testutil import import_blocker

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "config" / "env").glob("*.yaml"))
BLOCKED = ("mujoco", "robosuite", "libero", "gym_hil", "bddl", "gymnasium.envs.mujoco")


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "config" / "env" / f"{name}.yaml").read_text())


def _simulator(cfg: dict) -> str | None:
    """The package an env config needs to build its env (None: not buildable here)."""
    name = cfg["name"]
    if name.startswith("libero"):
        return "libero"  # spaces only: the LIBERO sim is built on the first reset
    if name == "gym_hil":
        return "gym_hil"
    if name in ("reacher", "inverted_pendulum"):
        return "mujoco"
    if name == "point_reach":
        return "numpy"  # pure numpy, no simulator
    return None


VARIANTS = {
    "default": {},
    "size64_limit7": {"image_size": 64, "max_episode_steps": 7},
    "render96_crop": {"render_size": 96, "image_size": [48, 64], "crop": [0.1, 0.1, 0.8, 0.8]},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem != "robot"], ids=lambda p: p.stem)
def test_env_spec_matches_the_built_env(path, variant):
    cfg = {**yaml.safe_load(path.read_text()), **VARIANTS[variant]}
    sim = _simulator(cfg)
    if sim is None or importlib.util.find_spec(sim) is None:
        pytest.skip(f"{path.name}: {sim} is not installed")
    computed = env_spec(cfg)
    env = make_env(cfg)
    try:
        assert computed == spec_from_env(env)
    finally:
        env.close()
    if variant == "render96_crop" and computed.cameras:
        assert set(computed.cameras.values()) == {(48, 64, 3)}
    if variant == "size64_limit7":
        assert computed.max_episode_steps == 7


@pytest.mark.parametrize("task,state_dim", [("PandaPickCube", 21), ("PandaArrangeBoxes", 33)])
def test_gym_hil_state_only_spec_counts_the_objects(task, state_dim):
    pytest.importorskip("gym_hil")
    cfg = {**_load("gym_hil_pick_cube"), "task": task, "cameras": {}}
    assert env_spec(cfg) == EnvSpec(state_dim=state_dim, action_dim=4, has_task=True,
                                    max_episode_steps=100)
    env = make_env(cfg)
    try:
        assert spec_from_env(env) == env_spec(cfg)
    finally:
        env.close()


def test_robot_needs_a_spec_block_and_then_matches_the_env():
    cfg = _load("robot")
    with pytest.raises(ValueError, match="add a spec: block to the env config"):
        env_spec(cfg)
    cfg.update(port=1, image_size=64, spec={
        "state_dim": 18, "action_dim": 4, "cameras": {"front": [480, 640, 3], "wrist": [480, 640, 3]},
        "has_task": True, "default_max_episode_steps": 100, "ee_pos_index": [15, 16, 17]})
    expected = EnvSpec(state_dim=18, action_dim=4, has_task=True, max_episode_steps=100,
                       cameras={"front": (64, 64, 3), "wrist": (64, 64, 3)})
    assert env_spec(cfg) == expected
    env = make_env(cfg)  # with a spec block nothing is contacted before reset
    try:
        assert spec_from_env(env) == expected
    finally:
        env.close()


def test_a_spec_block_wins_and_the_wrappers_still_apply():
    cfg = {**_load("libero_spatial"), "image_size": 32, "max_episode_steps": 9,
           "spec": {"state_dim": 9, "action_dim": 7, "cameras": {"image": [256, 256, 3]},
                    "has_task": True}}
    assert env_spec(cfg) == EnvSpec(state_dim=9, action_dim=7, cameras={"image": (32, 32, 3)},
                                    has_task=True, max_episode_steps=9)
    with pytest.raises(ValueError, match="lacks action_dim"):
        env_spec({"name": "reacher", "spec": {"state_dim": 3}})
    with pytest.raises(ValueError, match=r"camera 'c' must be \[H, W, 3\]"):
        env_spec({"name": "reacher", "spec": {"state_dim": 3, "action_dim": 1, "cameras": {"c": [4, 4]}}})


def test_unknown_envs_and_envs_without_a_static_spec_are_clear_errors():
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        env_spec({"name": "nope"})
    with pytest.raises(ValueError, match="has no 'name'"):
        env_spec({"image_size": 64})
    with pytest.raises(ValueError, match="unknown LIBERO suite"):
        env_spec({"name": "libero", "suite": "libero_100"})
    with pytest.raises(ValueError, match="unknown gym-hil task"):
        env_spec({"name": "gym_hil", "task": "PandaStackCubes"})
    registry.register("specless_test_env", lambda cfg: None, overwrite=True)
    with pytest.raises(ValueError, match="has no static spec: add a spec: block"):
        env_spec({"name": "specless_test_env"})
    assert env_spec({"name": "specless_test_env", "spec": {"state_dim": 2, "action_dim": 1}}) == \
        EnvSpec(state_dim=2, action_dim=1)
    registry.register("specless_test_env", lambda cfg: None, overwrite=True,
                      spec=lambda cfg: EnvSpec(state_dim=5, action_dim=2, max_episode_steps=20))
    assert env_spec({"name": "specless_test_env", "max_episode_steps": 0}).max_episode_steps == 20
    assert env_spec({"name": "libero", "suite": "libero_goal"}).max_episode_steps == 300
    assert set(registry.LIBERO_SUITES) <= set(registry.registered())


# Installed before envs.registry is imported: any import of a blocked module fails, and is noted.
RUNNER = """
import json
import yaml
from envs.registry import env_spec
specs = {n: env_spec(yaml.safe_load(open(f"config/env/{n}.yaml"))).to_dict()
         for n in ("libero_spatial", "gym_hil_pick_cube", "inverted_pendulum", "reacher",
                   "point_reach")}
print(json.dumps({"specs": specs, "tried": tried, "loaded": blocked_loaded()}))
"""


def test_env_spec_imports_no_simulator():
    code = import_blocker(BLOCKED) + RUNNER
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tried"] == [] and res["loaded"] == [], res
    specs = {k: EnvSpec.from_dict(v) for k, v in res["specs"].items()}
    assert specs["libero_spatial"] == EnvSpec(
        state_dim=8, action_dim=7, has_task=True, max_episode_steps=220,
        cameras={"image": (128, 128, 3), "wrist_image": (128, 128, 3)})
    assert specs["gym_hil_pick_cube"] == EnvSpec(
        state_dim=18, action_dim=4, has_task=True, max_episode_steps=100,
        cameras={"front": (128, 128, 3), "wrist": (128, 128, 3)})
    assert specs["inverted_pendulum"] == EnvSpec(state_dim=4, action_dim=1, max_episode_steps=100)
    assert specs["reacher"] == EnvSpec(state_dim=10, action_dim=2, max_episode_steps=50)
    assert specs["point_reach"] == EnvSpec(state_dim=2, action_dim=2, has_task=True,
                                           max_episode_steps=30, cameras={"image": (32, 32, 3)})
