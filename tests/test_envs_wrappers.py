"""Wrappers and the registry, on a tiny deterministic env (PointEnv) that speaks the schema."""

from __future__ import annotations

import string

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.transitions import TransitionBatch
from envs import registry
from envs import wrappers as W
from envs.spec import spec_from_env


class PointEnv(gym.Env):
    """A point in the unit cube moved by 0.1 * action[:3]; success within 0.1 of the goal.

    Observation: state = [x, y, z, gripper] float32, one 24x32 camera with a bright pixel
    at the point's (x, y), the task string. Action: [dx, dy, dz, gripper] in [-1, 1].
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
    ee_pos_index = (0, 1, 2)
    action_pos_index = (0, 1, 2)
    default_max_episode_steps = 30

    def __init__(self, goal=(0.8, 0.8, 0.5), size=(24, 32)):
        self.goal = np.asarray(goal, np.float64)
        self.size = size
        self.observation_space = spaces.Dict({
            OBS_STATE: spaces.Box(-np.inf, np.inf, (4,), np.float32),
            OBS_IMAGE_PREFIX + "cam": spaces.Box(0, 255, (*size, 3), np.uint8),
            TASK: spaces.Text(max_length=64, charset=string.printable),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.pos = np.zeros(3)
        self.grip = -1.0
        self.actions: list[np.ndarray] = []

    def _obs(self):
        img = np.zeros((*self.size, 3), np.uint8)
        h, w = self.size
        img[int(np.clip(self.pos[1], 0, 0.999) * h), int(np.clip(self.pos[0], 0, 0.999) * w)] = 255
        return {OBS_STATE: np.array([*self.pos, self.grip], np.float32), OBS_IMAGE_PREFIX + "cam": img,
                TASK: "reach the goal"}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(0.0, 0.3, 3)
        self.grip = -1.0
        return self._obs(), {"is_success": False}

    def step(self, action):
        a = np.asarray(action, np.float64)
        self.actions.append(a.copy())
        self.pos = self.pos + 0.1 * np.clip(a[:3], -1, 1)
        self.grip = float(np.clip(a[3], -1, 1))
        success = bool(np.linalg.norm(self.pos - self.goal) < 0.1)
        return self._obs(), float(success), success, False, {"is_success": success}


def toward_goal(env: PointEnv) -> np.ndarray:
    d = (env.goal - env.pos) / 0.1
    return np.concatenate([np.clip(d, -1, 1), [1.0]]).astype(np.float32)


@pytest.fixture(autouse=True)
def _point_env_registered():
    registry.register("point", lambda cfg: PointEnv(), overwrite=True)
    yield


def test_registry_dispatch_and_errors():
    env = registry.make_env({"name": "point"})
    assert isinstance(env.unwrapped, PointEnv)
    # the env's default limit is applied and visible to EnvSpec
    assert W.has_time_limit(env) and env.spec.max_episode_steps == 30
    spec = spec_from_env(env)
    assert spec.state_dim == 4 and spec.action_dim == 4 and spec.cameras == {"cam": (24, 32, 3)}
    assert spec.has_task and spec.max_episode_steps == 30
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        registry.make_env({"name": "nope"})
    with pytest.raises(ValueError, match="already registered"):
        registry.register("point", lambda cfg: PointEnv())
    for name in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90", "gym_hil", "robot"):
        assert name in registry.registered()


def test_registry_accepts_dictconfig():
    from omegaconf import OmegaConf

    env = registry.make_env(OmegaConf.create({"name": "point", "max_episode_steps": 7, "image_size": 16}))
    assert env.spec.max_episode_steps == 7
    assert env.observation_space[OBS_IMAGE_PREFIX + "cam"].shape == (16, 16, 3)


def test_time_limit_keeps_terminated_and_truncated_apart():
    env = W.TimeLimit(PointEnv(goal=(5, 5, 5)), 5)
    env.reset(seed=0)
    flags = [env.step(np.zeros(4, np.float32))[2:4] for _ in range(5)]
    assert flags[:4] == [(False, False)] * 4 and flags[4] == (False, True)
    # success on the very last allowed step: terminated, not truncated
    env = W.TimeLimit(PointEnv(goal=(0.0, 0.0, 0.0)), 1)
    env.reset(seed=0)
    env.unwrapped.pos = np.zeros(3)
    _, r, term, trunc, info = env.step(np.zeros(4, np.float32))
    assert (r, term, trunc) == (1.0, True, False) and "TimeLimit.truncated" not in info


def test_success_reward_from_info():
    class InfoOnly(gym.Wrapper):  # reward 0 always; success only in info
        def step(self, a):
            o, r, te, tr, i = self.env.step(a)
            return o, 0.0, False, tr, i

    env = W.SuccessReward(InfoOnly(PointEnv()), terminate=True)
    env.reset(seed=1)
    total, steps = 0.0, 0
    while steps < 40:
        _, r, term, trunc, info = env.step(toward_goal(env.unwrapped))
        total += r
        steps += 1
        if term:
            break
    assert term and total == 1.0 and info["is_success"]


def test_image_transform_crop_resize():
    env = W.ImageTransform(PointEnv(), size=(12, 12), crop=[0, 0, 24, 24])
    obs, _ = env.reset(seed=0)
    img = obs[OBS_IMAGE_PREFIX + "cam"]
    assert img.shape == (12, 12, 3) and img.dtype == np.uint8
    assert env.observation_space[OBS_IMAGE_PREFIX + "cam"].shape == (12, 12, 3)
    assert env.observation_space.contains(obs)
    frac = W.crop_image(np.zeros((100, 200, 3), np.uint8), [0.1, 0.25, 0.5, 0.5])
    assert frac.shape == (50, 100, 3)
    with pytest.raises(ValueError):
        W.crop_image(np.zeros((10, 10, 3), np.uint8), [5, 5, 10, 10])


def test_obs_remap_from_nested_dict():
    class Foreign(gym.Env):
        observation_space = spaces.Dict({
            "agent_pos": spaces.Box(-1, 1, (3,), np.float64),
            "pixels": spaces.Dict({"front": spaces.Box(0, 255, (8, 8, 3), np.uint8)}),
        })
        action_space = spaces.Box(-1, 1, (2,), np.float32)

        def reset(self, *, seed=None, options=None):
            return {"agent_pos": np.ones(3), "pixels": {"front": np.full((8, 8, 3), 7, np.uint8)}}, {}

        def step(self, a):
            return self.reset()[0], 0.0, False, False, {}

    env = W.ObsRemap(Foreign(), state=["agent_pos"], images={"front": "pixels/front"}, task="do it")
    obs, _ = env.reset()
    assert obs[OBS_STATE].dtype == np.float32 and obs[OBS_STATE].shape == (3,)
    assert obs[OBS_IMAGE_PREFIX + "front"][0, 0, 0] == 7 and obs[TASK] == "do it"
    assert env.observation_space.contains(obs)


def test_safety_clip_nonfinite_and_workspace():
    env = W.SafetyWrapper(PointEnv(), workspace_low=[0.0, 0.0, 0.0], workspace_high=[0.5, 0.5, 0.5])
    env.reset(seed=0)
    inner = env.unwrapped
    _, _, _, _, info = env.step(np.array([5, 0, 0, 0], np.float32))
    assert info["safety"]["clipped"] and np.allclose(inner.actions[-1], [1, 0, 0, 0])
    _, _, _, _, info = env.step(np.array([np.nan, 1, 0, 0], np.float32))
    assert info["safety"]["non_finite"] and np.allclose(inner.actions[-1], 0)
    # drive x to the upper bound: further +x is zeroed, -x still allowed
    for _ in range(10):
        _, _, _, _, info = env.step(np.array([1, 0, 0, 0], np.float32))
    x = inner.pos[0]
    assert x <= 0.5 + 0.1 + 1e-9 and info["safety"]["workspace"]
    assert inner.actions[-1][0] == 0.0
    env.step(np.array([-1, 0, 0, 0], np.float32))
    assert inner.actions[-1][0] == -1.0


def test_action_chunk_wrapper_executes_prefix_and_stops_at_end():
    env = W.ActionChunkWrapper(W.TimeLimit(PointEnv(goal=(5, 5, 5)), 4), chunk_size=3, execute=2)
    assert env.action_space.shape == (3, 4)
    env.reset(seed=0)
    chunk = np.tile(np.array([[0.5, 0, 0, 1]], np.float32), (3, 1))
    _, r, term, trunc, info = env.step(chunk)
    assert len(info["chunk"]) == 2 and not (term or trunc)
    _, r, term, trunc, info = env.step(chunk)
    assert len(info["chunk"]) == 2 and trunc  # the limit of 4 steps ends it
    assert len(env.unwrapped.actions) == 4


def test_episode_recorder_writes_transition_layout(tmp_path):
    env = W.EpisodeRecorder(W.TimeLimit(PointEnv(), 30), tmp_path)
    for ep in range(2):
        env.reset(seed=ep)
        while True:
            _, _, term, trunc, _ = env.step(toward_goal(env.unwrapped))
            if term or trunc:
                break
    env.close()
    files = sorted(tmp_path.glob("episode_*.npz"))
    assert len(files) == 2
    arrays, meta = W.load_episode(files[0])
    n = meta["length"]
    assert arrays["is_last"].tolist() == [False] * n + [True]
    assert arrays["terminated"][n - 1] and arrays["success"][n - 1] and meta["success"]
    assert arrays[OBS_IMAGE_PREFIX + "cam"].shape == (n + 1, 24, 32, 3)
    # the recording is a valid transition batch for this env
    spec = spec_from_env(W.TimeLimit(PointEnv(), 30))
    batch = TransitionBatch("recorder", 0, arrays, meta["tasks"])
    batch.validate(spec)


def test_reward_classifier_numpy_matches_torch_and_drives_reward(tmp_path):
    torch = pytest.importorskip("torch")
    from tools.train_reward_classifier import DEFAULT_CONVS, build_torch_model, export

    net = build_torch_model(1, DEFAULT_CONVS)
    model = export(net, ["cam"], 64, DEFAULT_CONVS, threshold=0.5)
    path = tmp_path / "rc.npz"
    model.save(path)
    loaded = W.RewardClassifier.load(path)
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 255, (5, 24, 32, 3), dtype=np.uint8)
    x = np.stack([W.resize_image(im, 64) for im in imgs]).astype(np.float32) / 255
    with torch.no_grad():
        ref = net([torch.from_numpy(x).permute(0, 3, 1, 2)]).numpy()
    assert np.allclose(loaded.logits({"cam": imgs}), ref, atol=1e-5)
    # threshold 0: every step is a success; threshold 1.1: none is
    env = W.RewardClassifierReward(PointEnv(goal=(5, 5, 5)), path, threshold=0.0)
    env.reset(seed=0)
    _, r, term, _, info = env.step(np.zeros(4, np.float32))
    assert r == 1.0 and term and 0.0 <= info["success_prob"] <= 1.0 and info["env_success"] is False
    env = W.RewardClassifierReward(PointEnv(goal=(5, 5, 5)), path, threshold=1.1)
    env.reset(seed=0)
    assert env.step(np.zeros(4, np.float32))[1:3] == (0.0, False)


def test_train_reward_classifier_tool_learns_a_visual_success(tmp_path):
    pytest.importorskip("torch")
    from tools.train_reward_classifier import main

    # record episodes: successful ones end near the goal (bright pixel bottom right)
    rec = W.EpisodeRecorder(W.TimeLimit(PointEnv(), 30), tmp_path / "rec")
    for ep in range(6):
        rec.reset(seed=ep)
        for _ in range(30):
            a = toward_goal(rec.unwrapped) if ep % 2 == 0 else -toward_goal(rec.unwrapped)
            _, _, term, trunc, _ = rec.step(a)
            if term or trunc:
                break
    rec.close()
    out = tmp_path / "rc.npz"
    assert main(["--episodes", str(tmp_path / "rec"), "--cameras", "cam", "--positive-last", "3",
                 "--out", str(out), "--epochs", "12", "--input-size", "48", "--val-frac", "0"]) == 0
    model = W.RewardClassifier.load(out)
    env = PointEnv()
    env.reset(seed=0)
    env.pos = env.goal.copy()
    p_goal = model.predict_proba(env._obs())
    env.pos = np.zeros(3)
    p_far = model.predict_proba(env._obs())
    assert p_goal > p_far


def test_reward_classifier_coefficients_mix_the_learned_and_the_env_reward(tmp_path):
    pytest.importorskip("torch")
    from envs.registry import make_env
    from tools.train_reward_classifier import DEFAULT_CONVS, build_torch_model, export

    path = tmp_path / "rc.npz"
    export(build_torch_model(1, DEFAULT_CONVS), ["cam"], 64, DEFAULT_CONVS, threshold=0.5).save(path)
    # the point put on the goal: the env's own reward is 1 on the first step
    env = W.RewardClassifierReward(PointEnv(goal=(0, 0, 0)), path, threshold=0.0, coef=0.5, env_coef=2.0)
    env.reset(seed=0)
    env.unwrapped.pos = np.zeros(3)
    _, r, term, _, info = env.step(np.zeros(4, np.float32))
    assert r == pytest.approx(0.5 * 1 + 2.0 * 1) and term and info["env_reward"] == 1.0
    env = W.RewardClassifierReward(PointEnv(goal=(0, 0, 0)), path, threshold=1.1, coef=0.5, env_coef=2.0)
    env.reset(seed=0)
    env.unwrapped.pos = np.zeros(3)
    _, r, term, _, info = env.step(np.zeros(4, np.float32))
    assert r == pytest.approx(2.0) and term and info["is_success"] is False  # the env still ends it
    env = W.RewardClassifierReward(PointEnv(goal=(5, 5, 5)), path, threshold=0.0, coef=0.5)
    env.reset(seed=0)
    assert env.step(np.zeros(4, np.float32))[1] == pytest.approx(0.5)  # default env_coef 0
    with pytest.raises(ValueError, match="reward_classifier.coef must be a finite number"):
        W.RewardClassifierReward(PointEnv(), path, coef=float("nan"))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['coeff'\]"):
        make_env({"name": "point_reach", "reward_classifier": {"path": str(path), "coeff": 2.0}})
