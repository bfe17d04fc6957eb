"""Human intervention: the wrapper, the scripted source, a real terminal (pty) for the
keyboard source, absent devices, and an intervention recorded end to end into the
transition message the learner decodes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from data.core.codec import decode
from data.core.schema import OBS_STATE
from data.core.transitions import TransitionBatch
from envs import wrappers as W
from envs.intervention import (
    DeviceUnavailable, GamepadIntervention, InterventionWrapper, KeyboardIntervention,
    ScriptedIntervention, SpaceMouseIntervention, default_action_map, make_source,
)
from envs.registry import make_env
from envs.spec import spec_from_env
from test_envs_wrappers import PointEnv

HUMAN = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
POLICY = np.array([1.0, 0.0, 0.0, -1.0], np.float32)


def run_episode(env, seed=0, max_steps=50):
    env.reset(seed=seed)
    infos = []
    for _ in range(max_steps):
        _, r, term, trunc, info = env.step(POLICY)
        infos.append((r, term, trunc, info))
        if term or trunc:
            break
    return infos


def test_takeover_replaces_the_action_and_is_flagged():
    src = ScriptedIntervention(takeover=[range(2, 5)], action=HUMAN)
    env = InterventionWrapper(W.TimeLimit(PointEnv(goal=(9, 9, 9)), 8), src)
    infos = run_episode(env)
    flags = [i["intervened"] for *_, i in infos]
    assert flags == [False, False, True, True, True, False, False, False]
    applied = env.unwrapped.actions
    for t, (*_, info) in enumerate(infos):
        expected = HUMAN if flags[t] else POLICY
        assert np.allclose(applied[t], expected)
        assert np.allclose(info["policy_action"], POLICY)
        assert ("human_action" in info) == flags[t]
    assert infos[-1][2] is True  # time limit


def test_labels_end_the_episode():
    env = InterventionWrapper(PointEnv(goal=(9, 9, 9)), ScriptedIntervention(events={3: "success"}))
    infos = run_episode(env)
    r, term, trunc, info = infos[-1]
    assert len(infos) == 4 and (r, term, trunc) == (1.0, True, False)
    assert info["is_success"] and info["human_label"] == "success"
    env = InterventionWrapper(PointEnv(goal=(9, 9, 9)), ScriptedIntervention(events={1: "failure"}))
    r, term, trunc, info = run_episode(env)[-1]
    assert (r, term, trunc) == (0.0, True, False) and info["is_success"] is False
    env = InterventionWrapper(PointEnv(goal=(9, 9, 9)), ScriptedIntervention(events={2: ["reset"]}))
    r, term, trunc, info = run_episode(env)[-1]
    assert (term, trunc) == (False, True) and info["human_reset"]
    with pytest.raises(ValueError, match="unknown events"):
        ScriptedIntervention(events={0: "celebrate"})


def test_intervention_recorded_end_to_end_into_the_transition_message(tmp_path):
    """policy + human takeover -> recorder -> TransitionBatch -> wire frames -> learner decode."""
    env = W.EpisodeRecorder(
        InterventionWrapper(W.TimeLimit(PointEnv(goal=(9, 9, 9)), 6),
                            ScriptedIntervention(takeover=[1, 2], action=HUMAN)),
        tmp_path)
    run_episode(env, seed=3)
    env.close()
    arrays, meta = W.load_episode(tmp_path / "episode_000000.npz")
    assert meta["interventions"] == 2
    spec = spec_from_env(W.TimeLimit(PointEnv(), 6))
    batch = TransitionBatch("actor-0", 100, arrays, meta["tasks"])
    batch.validate(spec)
    msg = decode(batch.to_frames())  # what the learner's service decodes
    received = TransitionBatch.from_message(msg)
    received.validate(spec)
    a = received.arrays
    assert a["intervened"].tolist() == [False, True, True, False, False, False, False]
    assert np.allclose(a["action"][1], HUMAN) and np.allclose(a["action"][2], HUMAN)
    assert np.allclose(a["action"][0], POLICY) and np.allclose(a["action"][3], POLICY)
    assert a["is_last"].tolist() == [False] * 6 + [True] and a["truncated"][5]
    # obs_t precedes action t: y grows only after the human's two steps
    y = a[OBS_STATE][:, 1]
    assert np.isclose(y[1], y[0]) and y[3] > y[2] > y[1] and np.isclose(y[4], y[3])


def test_generic_device_command_maps_onto_gym_hil_actions():
    assert default_action_map(7) == list(range(7)) and default_action_map(4) == [0, 1, 2, 6]
    with pytest.raises(ValueError, match="action_map"):
        default_action_map(5)
    cmd = np.array([0, 0, 1, 0, 0, 0.5, 1], np.float32)  # up, some yaw, close
    env = InterventionWrapper(
        make_env({"name": "gym_hil", "cameras": {}, "max_episode_steps": 3}),
        ScriptedIntervention(takeover=range(0, 3), action=cmd, env_space=False))
    try:
        obs, _ = env.reset(seed=0)
        z0 = obs[OBS_STATE][17]
        for _ in range(3):
            obs, _, _, _, info = env.step(np.zeros(4, np.float32))
        assert np.allclose(info["human_action"], [0, 0, 1, 1])
        assert obs[OBS_STATE][17] > z0 + 0.03
    finally:
        env.close()


def test_keyboard_over_a_real_pseudo_terminal():
    import termios

    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    kb = KeyboardIntervention(fd=slave, hold_s=0.3, echo_help=False)
    kb.start()
    try:
        assert termios.tcgetattr(slave)[3] != before[3]  # cbreak: no canonical mode / echo

        def poll_after(keys: bytes):
            if keys:
                os.write(master, keys)
            time.sleep(0.15)
            return kb.poll()

        assert poll_after(b"").active is False
        st = poll_after(b"iw")
        assert st.active and st.action[0] == 1.0 and st.action[6] == -1.0
        st = poll_after(b" \x1b[D")                    # gripper toggle, arrow left (+y)
        assert st.action[6] == 1.0 and st.action[1] == 1.0
        time.sleep(0.4)                                  # keys released (no repeats)
        st = kb.poll()
        assert st.active and np.allclose(st.action[:6], 0)
        st = poll_after(b"y")
        assert st.events == {"success"}
        assert poll_after(b"").events == set()           # events are one-shot
        st = poll_after(b"ix")
        assert not st.active and st.events == {"reset"}
        kb.close()
        assert termios.tcgetattr(slave)[3] == before[3]  # terminal restored
    finally:
        kb.close()
        os.close(master)
        os.close(slave)


def test_absent_devices_say_so(tmp_path):
    r, w = os.pipe()
    try:
        with pytest.raises(DeviceUnavailable, match="not a TTY"):
            KeyboardIntervention(fd=r).start()
    finally:
        os.close(r)
        os.close(w)
    pygame = pytest.importorskip("pygame")
    pygame.init()
    pygame.joystick.init()
    if pygame.joystick.get_count() == 0:
        with pytest.raises(DeviceUnavailable, match="no gamepad"):
            GamepadIntervention().start()
    try:
        import hid

        present = any(d["vendor_id"] in (0x256F, 0x046D) for d in hid.enumerate())
    except ImportError:
        present = False
    if not present:
        with pytest.raises(DeviceUnavailable, match="SpaceMouse"):
            SpaceMouseIntervention().start()
    with pytest.raises(ValueError, match="must be one of"):
        make_source("joystick")


def test_make_env_puts_intervention_above_safety_and_below_the_recorder(tmp_path):
    from envs import registry

    registry.register("point", lambda cfg: PointEnv(goal=(9, 9, 9)), overwrite=True)
    src = ScriptedIntervention(takeover=[0, 1], action=np.array([3.0, 0, 0, 1], np.float32))
    env = make_env({"name": "point", "max_episode_steps": 3, "record_dir": str(tmp_path),
                    "safety": {"workspace_low": [-2, -2, -2], "workspace_high": [-1, 2, 2]}},
                   intervention=src)
    env.reset(seed=0)
    infos = [env.step(POLICY)[4] for _ in range(3)]
    env.close()
    # the human's +x command (3.0: clipped to 1 by the action space) leaves the workspace
    # (x is beyond its upper bound): the safety wrapper beneath zeroes it, and the recorded
    # human action is what reached the env
    assert infos[0]["intervened"] and np.allclose(infos[0]["human_action"], [0, 0, 0, 1])
    assert np.allclose(env.unwrapped.actions[0], [0, 0, 0, 1])
    assert not infos[2]["intervened"] and np.allclose(env.unwrapped.actions[2], [0, 0, 0, -1])
    arrays, meta = W.load_episode(tmp_path / "episode_000000.npz")
    assert arrays["intervened"].tolist() == [True, True, False, False]
    assert np.allclose(arrays["action"][:2], [[0, 0, 0, 1]] * 2)
