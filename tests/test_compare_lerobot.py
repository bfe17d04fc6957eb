"""tools/bench/compare_lerobot: the rows computed from captured LeRobot event lines and Tandem status
samples, the summaries over repeats, the ratios' orientation, each setting's options, and
LeRobot's pipeline config built and validated with the ``dataset: null`` patch (no process is
started)."""

from __future__ import annotations

import argparse
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.compare_lerobot.__main__ import SETTINGS, TASKS, tandem_overrides, tandem_publish_every
from tools.bench.compare_lerobot.analyze import (lerobot_rows, parse_events, ratios, summarize, tandem_rows,
                                                 windowed_success_time)

ROOT = Path(__file__).resolve().parents[1]

# as lerobot_entry prints them, interleaved with LeRobot's own log lines
LEROBOT_LINES = """\
INFO 2026-11-25 23:01:02 ils/utils.py:64 [LEARNER] gRPC server started
CMPEVENT {"ev": "start", "t": 1000.0, "role": "learner"}
CMPEVENT {"ev": "push", "t": 1001.0, "step": 0}
CMPEVENT {"ev": "step", "t": 1010.0, "r": 0.0, "done": false}
CMPEVENT {"ev": "step", "t": 1011.0, "r": 1.0, "done": true}
CMPEVENT {"ev": "step", "t": 1012.0, "r": 0.0, "done": false}
CMPEVENT {"ev": "ingest", "t": 1012.5, "n": 2}
CMPEVENT {"ev": "update", "t": 1013.0}
CMPEVENT {"ev": "push", "t": 1013.1, "step": 1}
CMPEVENT {"ev": "update", "t": 1015.0}
CMPEVENT {"ev": "step", "t": 1016.0, "r": 0.0, "done": true}
CMPEVENT {"ev": "load", "t": 1016.1}
CMPEVENT {"ev": "update", "t": 1017.0}
CMPEVENT {"ev": "ingest", "t": 1017.5, "n": 4}
CMPEVENT {"ev": "push", "t": 1018.0, "step": 3}
CMPEVENT {"ev": "update", "t": 1019.0}
CMPEVENT {"ev": "step", "t": 1019.5, "r": 0.0, "done": true}
CMPEVENT {"ev": "load", "t": 1020.0}
CMPEVENT {"ev": broken
INFO 2026-11-25 23:01:30 actor.py:385 [ACTOR] Global step 4: Episode reward: 0.0
"""


def test_parse_events_keeps_only_event_lines():
    events = parse_events(LEROBOT_LINES.splitlines())
    assert len(events) == 17
    assert {e["ev"] for e in events} == {"start", "push", "step", "ingest", "update", "load"}


def test_lerobot_rows_from_captured_events():
    events = parse_events(LEROBOT_LINES.splitlines())
    rows = lerobot_rows(events, 1020.0, threshold=0.5, window=2)
    assert rows["env_steps"] == 5
    assert rows["env_steps_per_s"] == pytest.approx(5 / 10.0)  # first step at 1010, end 1020
    assert rows["updates"] == 4
    assert rows["updates_per_s"] == pytest.approx(4 / 7.0)  # first update at 1013
    assert rows["transitions"] == 4 and rows["transitions_per_s"] == pytest.approx(0.4)
    # updates 1013 -> push 1013.1 (v1) -> load 1016.1: 3.1; 1015 and 1017 -> push 1018 (v2) ->
    # load 1020: 5 and 3; 1019: no push after it, not acted on by the end
    assert rows["update_to_act_s"] == {"median": 3.1, "mean": 3.7, "n": 3, "censored": 1}
    # episodes end at 1011 (success), 1016, 1019.5: window 2 reaches 0.5 at the second end
    assert rows["episodes"] == 3 and rows["successes"] == 1
    assert rows["time_to_success_s"] == 6.0
    assert rows["first_trained_weights_acted_s"] == pytest.approx(6.1)
    # success over the last 2 episodes (fewer at first) at each episode end
    assert rows["success_curve"] == [[1.0, 1.0, 1], [6.0, 0.5, 2], [9.5, 0.0, 3]]
    assert rows["updates_curve"] == [[0.0, 0], [3.0, 1], [5.0, 2], [7.0, 3], [9.0, 4], [10.0, 4]]


def test_windowed_success_needs_a_full_window():
    outcomes = [(1.0, True), (2.0, False), (3.0, True), (4.0, True)]
    assert windowed_success_time(outcomes, 0.0, threshold=1.0, window=2) == 4.0
    assert windowed_success_time(outcomes, 0.0, threshold=1.0, window=5) is None


def status(env_steps, updates, version, actor_version, episodes=0, success=None):
    return {"env_steps": env_steps, "updates": updates, "version": version, "episodes": episodes,
            "success": success, "actors_table": [{"actor": "a0", "version": actor_version}]}


def test_tandem_rows_from_status_samples_and_actor_log():
    samples = [
        {"t": 100.0, "status": status(0, 0, 0, -1)},
        {"t": 101.0, "status": status(5, 0, 0, 0)},
        {"t": 103.0, "status": status(15, 2, 2, 0)},
        {"t": 104.0, "status": status(20, 4, 4, 2)},
        {"t": 106.0, "status": status(30, 8, 8, 8, episodes=3, success=0.67)},
        {"t": 111.0, "status": status(55, 18, 18, 18, episodes=5, success=0.4)},
    ]
    lines = [(101.5, "INFO steps 6 | 5 steps/s | episodes 0 | return nan | version 0"),
             (104.5, "INFO steps 21 | 5 steps/s | episodes 0 | return nan | version 2 | unacked 0"),
             (106.0, "INFO steps 30 | 5 steps/s | episodes 3 | return nan | version 8 | unacked 0"),
             (109.5, "INFO steps 46 | 5 steps/s | episodes 4 | return 0.1 | version 8"),
             (110.0, "unrelated line")]
    rows = tandem_rows(samples, lines, 111.0, threshold=0.5, window=3)
    assert rows["env_steps_per_s"] == pytest.approx(40 / 8.0)
    assert rows["transitions_per_s"] == pytest.approx(50 / 10.0)
    assert rows["updates_per_s"] == pytest.approx(16 / 8.0)  # from the first sample with updates
    # updates first counted: 1-2 at 103, 3-4 at 104, 5-8 at 106, 9-18 at 111 (publish_every 1:
    # version k holds update k); the actor's log shows v2 at 104.5 and v8 at 106: 1.5, 1.5,
    # 2.0, 2.0, then 0.0 four times; 9-18 never acted on
    assert rows["update_to_act_s"] == {"median": 0.75, "mean": 0.88, "n": 8, "censored": 10}
    assert rows["time_to_success_s"] == 5.0
    assert rows["first_trained_weights_acted_s"] == 3.5
    assert rows["success_curve"] == [[5.0, 0.67, 3], [10.0, 0.4, 5]]
    # without versions in the actor's lines: the status samples' per-actor versions (v2 at 104,
    # v8 at 106, v18 at 111): 1.0, 1.0, 2.0, 2.0 and fourteen 0.0
    bare = [(t, line.split(" | version")[0]) for t, line in lines]
    rows = tandem_rows(samples, bare, 111.0, threshold=0.5, window=3)
    assert rows["update_to_act_s"] == {"median": 0.0, "mean": 0.33, "n": 18, "censored": 0}


def test_tandem_latency_waits_for_the_version_that_holds_the_update():
    """publish_every 4: version k holds updates up to 4k, so updates 1-3 wait for version 1."""
    samples = [{"t": 100.0, "status": status(5, 0, 0, 0)}, {"t": 102.0, "status": status(8, 3, 0, 0)},
               {"t": 104.0, "status": status(10, 4, 1, 0)}, {"t": 108.0, "status": status(20, 8, 2, 1)}]
    lines = [(101.0, "INFO steps 6 | 5 steps/s | episodes 0 | return nan | version 0"),
             (105.0, "INFO steps 12 | 5 steps/s | episodes 0 | return nan | version 1"),
             (109.0, "INFO steps 22 | 5 steps/s | episodes 0 | return nan | version 2")]
    rows = tandem_rows(samples, lines, 110.0, threshold=0.5, window=3, publish_every=4)
    # updates 1-3 (102) -> v1 at 105: 3.0 each; 4 (104) -> 105: 1.0; 5-8 (108) -> v2 at 109: 1.0
    assert rows["update_to_act_s"] == {"median": 1.0, "mean": 1.75, "n": 8, "censored": 0}


def test_summarize_reports_median_and_range_over_runs():
    runs = [{"updates_per_s": 1.0, "update_to_act_s": {"median": 2.0}, "time_to_success_s": None},
            {"updates_per_s": 3.0, "update_to_act_s": {"median": 4.0}, "time_to_success_s": None},
            {"updates_per_s": 2.0, "update_to_act_s": None, "time_to_success_s": 50.0},
            {"error": "RuntimeError: no env step within 400 s"}]
    s = summarize(runs)
    assert s["runs"] == 4 and s["errors"] == 1
    assert s["updates_per_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [1.0, 3.0, 2.0]}
    assert s["update_to_act_s"] == {"median": 3.0, "min": 2.0, "max": 4.0, "values": [2.0, 4.0, None]}
    assert s["time_to_success_s"]["median"] == 50.0 and s["time_to_success_s"]["values"] == [None, None, 50.0]


def test_settings_set_each_sides_runtime_options_and_keep_the_setup(tmp_path):
    args = argparse.Namespace(hidden=[256, 256], channels=32, latent_dim=256, render="fast", freeze_backbone=1,
                              batch=128, utd=2, success_window=10)
    d_common, d_learner, _ = tandem_overrides(args, tmp_path, "defaults")
    b_common, b_learner, _ = tandem_overrides(args, tmp_path, "best")
    # defaults: Tandem's own cadence (publish every 25 updates, config/algo/sac.yaml)
    assert not any(o.startswith(("algo.publish_every", "algo.max_update_ratio")) for o in d_learner)
    assert tandem_publish_every(d_learner) == 25
    assert "algo.publish_every=1" in b_learner and "algo.max_update_ratio=0" in b_learner
    assert tandem_publish_every(b_learner) == 1
    # the setup is the same in both: only the setting's options differ
    assert d_common == b_common
    # --tandem-extra: an ablation's overrides reach Tandem's learner, nothing else changes
    args.tandem_extra = ["buffer.persist=false"]
    a_common, a_learner, _ = tandem_overrides(args, tmp_path, "defaults")
    assert a_common == d_common and [o for o in a_learner if o not in d_learner] == ["buffer.persist=false"]
    assert [o for o in b_learner if o not in SETTINGS["best"]["tandem"]] == d_learner
    assert SETTINGS["defaults"]["lerobot_push_s"] == 4.0 and SETTINGS["best"]["lerobot_push_s"] == 0.0


def test_tasks_give_each_side_the_same_task_and_keep_pick_cube_as_it_was(tmp_path):
    args = argparse.Namespace(hidden=[256, 256], channels=32, latent_dim=256, render="fast", freeze_backbone=1,
                              batch=128, utd=2, success_window=20)
    pick, _, _ = tandem_overrides(argparse.Namespace(**vars(args), task="pick_cube"), tmp_path)
    assert pick == tandem_overrides(args, tmp_path)[0]  # no --task: pick_cube
    assert pick[:2] == ["env=gym_hil_pick_cube", "env.render_quality=fast"]
    assert TASKS["pick_cube"]["lerobot"] == [] and TASKS["pick_cube"]["json"] == "compare.json"
    # pendulum: Tandem's cart-pole, the state embedded as LeRobot's gaussian_actor does; in best
    # only, Tandem's replay stays in memory
    pa = argparse.Namespace(**vars(args), task="pendulum")
    d_common, d_learner, _ = tandem_overrides(pa, tmp_path, "defaults")
    b_common, b_learner, _ = tandem_overrides(pa, tmp_path, "best")
    assert d_common[0] == "env=inverted_pendulum" and not any("render_quality" in o for o in d_common)
    assert "++policy.state_embed_without_images=true" in d_common and d_common == b_common
    assert "buffer.persist=false" in b_learner and "buffer.persist=false" not in d_learner
    assert "logging.stats_window=20" in d_learner
    assert TASKS["pendulum"]["lerobot"] == ["--obs", "pendulum", "--fps", "0"]
    # state-only pick-cube: the same env options on both sides
    sc, _, _ = tandem_overrides(argparse.Namespace(**vars(args), task="pick_cube_state"), tmp_path)
    assert {"~env.cameras", "+env.cameras={}", "env.reward_type=dense", "env.random_block_position=false",
            "env.include_env_state=true"} <= set(sc)
    lr = TASKS["pick_cube_state"]["lerobot"]
    assert lr[lr.index("--reward-type") + 1] == "dense" and lr[lr.index("--random-block") + 1] == "0"
    assert len({t["json"] for t in TASKS.values()}) == len({t["png"] for t in TASKS.values()}) == len(TASKS)


def test_lerobot_success_is_the_envs_flag_where_logged():
    """A dense reward never reaches 1: success comes from the logged ``ok`` (gym-hil's
    ``info["succeed"]``); without it a sparse reward of 1 counts."""
    lines = [
        'CMPEVENT {"ev": "step", "t": 1.0, "r": 0.4, "done": false, "ok": false}',
        'CMPEVENT {"ev": "step", "t": 2.0, "r": 0.9, "done": true, "ok": true}',
        'CMPEVENT {"ev": "step", "t": 3.0, "r": 1.0, "done": true, "ok": false}',
        'CMPEVENT {"ev": "step", "t": 4.0, "r": 0.2, "done": true, "ok": true}',
    ]
    rows = lerobot_rows(parse_events(lines), 5.0, threshold=0.5, window=2)
    assert rows["episodes"] == 3 and rows["successes"] == 2
    assert rows["time_to_success_s"] == 2.0 and rows["final_success"] == 0.5  # from the first step


def test_ratios_are_oriented_so_that_above_one_means_tandem_ahead():
    t = {"env_steps_per_s": 5.0, "updates_per_s": 1.0, "transitions_per_s": 5.0,
         "update_to_act_s": {"median": 0.5}, "time_to_success_s": None}
    lr = {"env_steps_per_s": 1.0, "updates_per_s": 2.0, "transitions_per_s": 1.0,
          "update_to_act_s": {"median": 5.0}, "time_to_success_s": 100.0}
    r = ratios(t, lr)
    assert r == {"env_steps_per_s": 5.0, "updates_per_s": 0.5, "transitions_per_s": 5.0,
                 "update_to_act_s": 10.0, "time_to_success_s": None, "final_success": None}


#: the two checks below import LeRobot's rl stack or start gym-hil in a subprocess (~1 min
#: together); they test the comparison tool's patches of LeRobot, not Tandem
bench = pytest.mark.skipif(not os.environ.get("TANDEM_BENCH_TESTS"),
                           reason="LeRobot comparison tool checks (~1 min): set TANDEM_BENCH_TESTS=1")


def lerobot_args(tmp_path, **kw) -> argparse.Namespace:
    """lerobot_entry's arguments for a small learner."""
    return argparse.Namespace(**{"latent_dim": 64, "channels": 8, "pool_features": 4, "freeze_vision_encoder": 1,
                                 "buffer": 100, "learning_starts": 10, "hidden": [32, 32], "port": 50000,
                                 "push_s": 4.0, "utd": 2, "out": str(tmp_path), "role": "learner", "batch": 16,
                                 "seed": 0, **kw})


@bench
def test_lerobot_config_builds_and_validates_with_no_dataset(tmp_path):
    pytest.importorskip("lerobot.rl.train_rl")
    from tools.bench.compare_lerobot.lerobot_entry import build_config, patch_validation

    patch_validation()
    cfg = build_config(lerobot_args(tmp_path))
    cfg.validate()
    assert cfg.dataset is None
    assert cfg.policy.actor_learner_config.learner_host == "127.0.0.1"
    assert cfg.algorithm.utd_ratio == 2 and cfg.batch_size == 16
    assert cfg.algorithm.critic_network_kwargs.hidden_dims == [32, 32]
    assert cfg.env.name == "gym_hil" and cfg.policy.type == "gaussian_actor"
    # the learner logs the whole config through draccus at start: it must encode
    assert cfg.to_dict()["env"]["name"] == "gym_hil"
    # make_policy reads the action feature from the env config
    from lerobot.envs.utils import env_to_policy_features

    feats = env_to_policy_features(cfg.env)
    assert feats["action"].shape == (4,) and feats["observation.images.front"].shape == (3, 128, 128)



@bench
def test_lerobot_learner_buffer_is_built_without_drq(tmp_path, capsys):
    """``--drq 0``: the learner's own ``initialize_replay_buffer`` (optimize_memory=True, use_drq
    at its default True) returns a buffer that samples without the random shift."""
    pytest.importorskip("lerobot.rl.train_rl")
    import lerobot.rl.learner as L

    from tools.bench.compare_lerobot.lerobot_entry import build_config, instrument_learner, patch_validation

    patch_validation()
    cfg = build_config(lerobot_args(tmp_path, push_s=0.0))
    saved = {k: getattr(L, k) for k in ("initialize_replay_buffer", "push_actor_policy_to_queue",
                                         "process_transitions")}
    from lerobot.rl.trainer import RLTrainer

    step = RLTrainer.training_step
    try:
        assert saved["initialize_replay_buffer"](cfg, "cpu", "cpu").use_drq is True  # LeRobot's own
        instrument_learner(drq=False)
        buf = L.initialize_replay_buffer(cfg, "cpu", "cpu")
    finally:
        for k, v in saved.items():
            setattr(L, k, v)
        RLTrainer.training_step = step
    assert buf.use_drq is False and buf.optimize_memory is True
    assert '"ev": "buffer"' in capsys.readouterr().out


FAST_RENDER_SCRIPT = """
import argparse, sys
import lerobot.rl.actor as A
from tools.bench.compare_lerobot.lerobot_entry import build_config, fast_render
args = argparse.Namespace(latent_dim=64, channels=8, pool_features=4, freeze_vision_encoder=1,
                          buffer=100, learning_starts=10, hidden=[32, 32], port=50000, push_s=4.0,
                          utd=2, out=sys.argv[1], role="actor", batch=16, seed=0)
fast_render()
env, _ = A.make_robot_env(cfg=build_config(args).env)
q = env.unwrapped.model.vis.quality
obs, _ = env.reset(seed=0)
img = obs["pixels"]["front"]
print("RESULT", q.shadowsize, q.offsamples, img.shape, float(img.std()) > 0)
env.close()
"""


@bench
def test_lerobot_fast_render_patch_renders_without_shadows(tmp_path):
    """In a fresh process (MuJoCo fixes its GL backend at import): LeRobot's own gym-hil env,
    patched, has no shadow map or multisampling and still renders the 128x128 cameras."""
    pytest.importorskip("gym_hil")
    gl = "osmesa" if ctypes.util.find_library("OSMesa") else "egl"  # an EGL-only machine too
    env = {**os.environ, "MUJOCO_GL": gl, "PYOPENGL_PLATFORM": gl, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", FAST_RENDER_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out.stderr[-3000:]
    assert line == "RESULT 0 0 (128, 128, 3) True"
