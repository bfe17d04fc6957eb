"""Rejection sampling (agents/rs/agent.py, agents/rs/builder.py), the scripted expert
(envs/intervention/expert.py) and tools/record_demos.py, without processes: the pure
functions, the success store (a view of the replay that a restarted learner refills from a
real LeRobot dataset), the cadence (pretrain -> evaluate -> collect -> train -> publish ->
keep or roll back) with its checkpoints, and the pairing check."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from agents import registry
from agents.base import check_pair
from agents.rs.agent import (BCAgent, RejectionSamplingConfig, bc_inputs, cosine_lr,
                                       episode_outcome, keep_version, scheduled_lr)
from agents.rs.jobs import EVAL_GROUP_BASE
from data.core.spec import EnvSpec
from data.core.transitions import TransitionBatch
from tandem_testutil import ROOT

SPEC = EnvSpec(state_dim=4, action_dim=2, max_episode_steps=10)
POLICY = {"name": "mlp", "hidden_dims": [16], "chunk_size": 1}


def episode(actor: str, ep: int, n: int, *, success=False, reward=0.0, intervened=(), group=-1,
            version=0, first_seq=0, spec=SPEC) -> TransitionBatch:
    """n steps + the is_last record; ``intervened``: step indices a person drove."""
    rng = np.random.default_rng(ep)
    m = n + 1
    arrays = {
        "observation.state": rng.normal(size=(m, spec.state_dim)).astype(np.float32),
        "action": rng.uniform(-0.9, 0.9, (m, spec.action_dim)).astype(np.float32),
        "reward": np.append(np.full(n, reward, np.float32), 0).astype(np.float32),
        "terminated": np.zeros(m, bool), "truncated": np.zeros(m, bool),
        "intervened": np.isin(np.arange(m), list(intervened)), "is_last": np.arange(m) == n,
        "success": np.zeros(m, bool), "policy_version": np.full(m, version, np.int64),
        "episode": np.full(m, ep, np.int64), "step": np.arange(m, dtype=np.int64),
        "chunk_start": np.ones(m, bool), "chunk_index": np.zeros(m, np.int64),
        "group_id": np.full(m, group, np.int64),
    }
    arrays["terminated"][n - 1] = success
    arrays["truncated"][n - 1] = not success
    arrays["success"][n - 1:] = success
    for k, (dt, shape) in spec.extras.items():
        arrays["extra." + k] = np.zeros((m, *shape), dt)
    return TransitionBatch(actor, first_seq, arrays, [""] * m)


def rs_cfg(**kw) -> dict:
    return {"name": "rejection_sampling", "batch_size": 8, **kw}


def build(tmp_path, algo: dict, *, demos=None, persist=False, steps=None):
    """Builder, networks, data and learner as learner/app.py makes them."""
    torch.manual_seed(0)
    builder = registry.build_builder(algo)
    policy = registry.build_policy(POLICY, SPEC)
    spec = SPEC.with_extras(policy.extras_spec())
    nets = builder.make_networks(spec, policy, torch.device("cpu"))
    replay = {"capacity": 2000, "persist": persist, "video": False, "demos": demos,
              "commit_interval_s": 0.0}
    data = builder.make_data(spec, replay, run_dir=tmp_path, seed=0, device="cpu", train=True)
    steps = steps if steps is not None else [0]
    # ingest's count: every stored env step, evaluation episodes' too (steps[0]: the others)
    learner = builder.make_learner(nets, data, Accelerator(cpu=True),
                                   env_steps=lambda: steps[0] + data.sink.counters["eval_steps"])
    return builder, data, learner, spec, steps


# -- pure functions -------------------------------------------------------------------------------
def test_cosine_schedule_and_outcome_and_gate():
    assert cosine_lr(0, 10, 1.0, 0.1) == 1.0
    assert cosine_lr(9, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert cosine_lr(50, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert cosine_lr(0, 1, 1.0, 0.1) == 1.0
    mid = cosine_lr(5, 11, 1.0, 0.1)
    assert mid == pytest.approx(0.55)
    cfg = RejectionSamplingConfig(lr=1.0, lr_min=0.1, sft_steps_per_cycle=11, lr_decay_steps=21)
    assert scheduled_lr(cfg, 5, 999) == pytest.approx(0.55)          # cycle: restarts
    cfg.lr_schedule = "run"
    assert scheduled_lr(cfg, 0, 10) == pytest.approx(0.55)           # run: one decay
    cfg.lr_schedule = "constant"
    assert scheduled_lr(cfg, 5, 10) == 1.0
    cfg = RejectionSamplingConfig(return_threshold=2.0)
    assert episode_outcome(True, 0.0, cfg) and not episode_outcome(False, 5.0, cfg)
    cfg.success_from = "return"
    assert episode_outcome(False, 2.0, cfg) and not episode_outcome(True, 1.9, cfg)
    cfg.success_from = "either"
    assert episode_outcome(True, 0.0, cfg) and episode_outcome(False, 3.0, cfg)
    assert keep_version(0.5, 0.5, 0.0) and not keep_version(0.45, 0.5, 0.0)
    assert keep_version(0.45, 0.5, 0.1)
    b = bc_inputs({"step_mask": torch.tensor([[True, True, False]])})
    assert b["action_is_pad"].tolist() == [[False, False, True]]


def test_config_file_matches_the_dataclass_and_bad_values_fail():
    from omegaconf import OmegaConf

    yaml = OmegaConf.load(ROOT / "config" / "algo" / "rejection_sampling.yaml")
    cfg = registry.make_config(RejectionSamplingConfig, yaml, "algo=rejection_sampling")
    import dataclasses

    assert set(yaml) - {"name"} == {f.name for f in dataclasses.fields(RejectionSamplingConfig)}
    assert cfg == RejectionSamplingConfig()  # the yaml holds the dataclass defaults
    for bad in ({"lr_schedule": "linear"}, {"success_from": "vibes"}, {"lr_min": 1.0, "lr": 0.1},
                {"sft_steps_per_cycle": 0}, {"demo_ratio": 1.5}):
        with pytest.raises(ValueError, match="algo=rejection_sampling"):
            registry.make_config(RejectionSamplingConfig, bad, "algo=rejection_sampling")
    assert RejectionSamplingConfig(eval_episodes=3, eval_task_ids=(0, 1)).eval_jobs() == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert RejectionSamplingConfig(eval_episodes=0).eval_jobs() == []


def test_pairing_requires_bc_policy(monkeypatch):
    class NoBC:
        chunk_size = 1

        def act(self, obs, deterministic=False): ...

        def sample(self, obs, prefix=""): ...

    with pytest.raises(ValueError, match="'rejection_sampling' cannot train policy 'NoBC'.*BCPolicy"):
        check_pair("rejection_sampling", RejectionSamplingConfig().requires, "NoBC", NoBC)
    monkeypatch.setitem(registry.POLICIES, "nobc", (__name__, "NoBC", "RejectionSamplingConfig"))
    globals()["NoBC"] = NoBC
    with pytest.raises(ValueError, match="'nobc'.*BCPolicy"):
        registry.check_algo_policy(rs_cfg(), "nobc")
    for name in ("mlp", "pi0", "pi05", "openvla_oft", "openvla_oft_discrete"):
        registry.check_algo_policy(rs_cfg(), name)  # every shipped policy clones


# -- the success store ---------------------------------------------------------------------------
def test_success_store_keeps_successes_and_interventions_not_evaluations(tmp_path):
    _, data, _, spec, _ = build(tmp_path, rs_cfg(eval_episodes=2))
    seq = 0
    for ep, kw in enumerate([dict(success=True), dict(success=False),
                             dict(success=False, intervened=(1, 2)),
                             dict(success=True, group=EVAL_GROUP_BASE)]):
        b = episode("a0", ep, 5, first_seq=seq, spec=spec, **kw)
        seq += len(b)
        data.sink.add(b)
    st = data.status()
    assert st["success_store"] == 5 + 2 and st["success_store_intervened"] == 2
    assert st["episodes"] == 3 and st["kept_episodes"] == 1 and st["eval_episodes"] == 1
    assert st["intervened_steps"] == 2 and st["eval_steps"] == 5
    batch = data.sampler.sample(200)
    assert set(batch["episode"].tolist()) == {0, 2}
    assert batch["intervened"][batch["episode"] == 2].all()


def test_return_threshold_outcome_survives_a_restart_from_the_dataset(tmp_path):
    """success_from=return: the sink decides from each episode's return; the dataset keeps the
    env's flag, and a restarted learner refills the store through the same decision."""
    algo = rs_cfg(success_from="return", return_threshold=2.0, eval_episodes=0)
    _, data, _, spec, _ = build(tmp_path, algo, persist=True)
    seq = 0
    for ep, r in enumerate([0.5, 0.1, 0.0]):  # returns 2.5 (kept), 0.5, 0.0 over 5 steps
        b = episode("a0", ep, 5, reward=r, first_seq=seq, spec=spec, intervened=(3,) if ep == 2 else ())
        seq += len(b)
        data.sink.add(b)
        from data.store import Episode

        data.store.submit(Episode.from_batch(b))
    assert data.store.flush(60)
    before = data.status()
    assert before["success_store"] == 6 and before["success_store_intervened"] == 1
    data.close()
    _, data2, _, _, _ = build(tmp_path, algo, persist=True)
    after = data2.status()
    assert after["dataset_episodes"] == 3 and after["transitions"] == 15
    assert after["success_store"] == 6 and after["success_store_intervened"] == 1
    assert set(data2.sampler.sample(100)["episode"].tolist()) == {0, 2}
    data2.close()


# -- the cadence -----------------------------------------------------------------------------------
def feed_eval_round(data, learner, builder, outcomes, *, actor="a0", first_ep=1000, version=None):
    """Run the current round's jobs as an actor would: ``outcomes[i]`` is job i's success."""
    version = learner.version if version is None else version
    jobs = builder.jobs()
    n = 0
    for i, ok in enumerate(outcomes):
        job = jobs.next_job(actor, first_ep + i)
        assert job is not None and job.deterministic and job.group_id >= EVAL_GROUP_BASE
        data.sink.add(episode(actor, first_ep + i, 3, success=ok, group=job.group_id,
                              version=version, first_seq=10_000 + 10 * i, spec=data.replay.buffer.spec))
        n += 1
    return n


def test_cadence_pretrain_eval_cycle_keep_rollback_and_resume(tmp_path):
    from tools.record_demos import record_demos

    demos = tmp_path / "demos"
    record_demos({"name": "point_reach", "num_tasks": 1, "cameras": {}, "state_has_target": True,
                  "randomize_targets": True}, demos, 3)
    algo = rs_cfg(pretrain_steps=3, env_steps_per_cycle=10, sft_steps_per_cycle=4, eval_episodes=4,
                  eval_tolerance=0.0)
    builder, data, learner, spec, steps = build(tmp_path / "a", algo, demos=str(demos))
    assert learner.phase == "pretrain" and builder.jobs().pending() == 0
    published = []
    for _ in range(3):
        m = learner.step()
        assert m is not None and "bc_loss" in m
        if learner.should_publish():
            published.append(learner.version)
    assert published == [1] and learner.phase == "eval" and learner.updates == 3
    assert learner.step() is None and builder.jobs().pending() == 4   # the round starts
    # a stale episode (begun under version 0) is re-queued, not counted
    job = builder.jobs().next_job("a1", 7)
    data.sink.add(episode("a1", 7, 3, success=True, group=job.group_id, version=0, spec=spec))
    assert learner.counters["stale_eval_episodes"] == 1 and builder.jobs().pending() == 4
    feed_eval_round(data, learner, builder, [True, False, False, False])
    m = learner.step()
    assert m["eval_success"] == 0.25 and learner.history[-1]["decision"] == "baseline"
    assert not learner.should_publish() and learner.phase == "collect"
    assert learner.step() is None                                     # waits for env steps
    steps[0] = 12
    outs = [learner.step() for _ in range(4)]
    assert all(o is not None for o in outs) and learner.should_publish() and learner.version == 2
    assert outs[0]["lr"] == pytest.approx(algo.get("lr", 1e-3))
    assert learner.step() is None
    feed_eval_round(data, learner, builder, [True, True, False, False], first_ep=2000)
    assert learner.step()["eval_success"] == 0.5 and learner.history[-1]["decision"] == "kept"
    assert learner.best_version == 2 and learner.best_success == 0.5
    best = {k: v.clone() for k, v in learner.policy.trainable_state_dict().items()}
    # a worse version is rolled back to the best weights and published again
    steps[0] = 30
    for _ in range(4):
        learner.step()
    assert learner.version == 3
    changed = learner.policy.trainable_state_dict()
    assert any(not torch.equal(changed[k], best[k]) for k in best)
    learner.step()
    feed_eval_round(data, learner, builder, [False, False, False, True], first_ep=3000)
    m = learner.step()
    assert learner.should_publish() and learner.version == 4 and learner.counters["rollbacks"] == 1
    assert learner.history[-1]["decision"].startswith("rolled back to v2")
    now = learner.policy.trainable_state_dict()
    assert all(torch.equal(now[k], best[k]) for k in best)
    # checkpoint mid-evaluation and resume in a new learner: the round starts again
    steps[0] = 50
    for _ in range(4):
        learner.step()
    learner.step()
    assert learner.phase == "eval" and learner.version == 5
    state = learner.state_dict()
    # a restarted app: ingest's restored count includes the evaluation steps
    _, data2, learner2, _, _ = build(tmp_path / "b", algo, demos=str(demos),
                                     steps=[50 + state["eval_steps"]])
    learner2.load_state_dict(state)
    for k in ("version", "updates", "cycles", "best_version", "best_success", "phase"):
        assert getattr(learner2, k) == getattr(learner, k), k
    assert learner2.counters == learner.counters and learner2.history == learner.history
    assert all(torch.equal(learner2.best[k], learner.best[k]) for k in learner.best)
    assert learner2.step() is None and learner2.jobs.pending() == 4
    assert learner2.online_steps() == learner.online_steps()
    data.close()
    data2.close()


def test_bc_agent_update_lowers_the_loss_and_chunks_mark_padding(tmp_path):
    torch.manual_seed(0)
    policy = registry.build_policy({**POLICY, "chunk_size": 3}, SPEC)
    agent = BCAgent(RejectionSamplingConfig(), policy, Accelerator(cpu=True))
    batch = {"observation.state": torch.randn(32, 4), "action": torch.rand(32, 3, 2) * 1.6 - 0.8,
             "step_mask": torch.ones(32, 3, dtype=torch.bool)}
    first = agent.update(batch, 1e-2)["bc_loss"]
    for _ in range(50):
        last = agent.update(batch, 1e-2)["bc_loss"]
    assert last < first - 1.0
    # gradient accumulation: the same step in pieces of 10, 10, 10, 2 rows
    torch.manual_seed(1)
    whole = registry.build_policy({**POLICY, "chunk_size": 3}, SPEC)
    pieces = copy.deepcopy(whole)
    a_whole = BCAgent(RejectionSamplingConfig(), whole, Accelerator(cpu=True))
    a_pieces = BCAgent(RejectionSamplingConfig(micro_batch_size=10), pieces, Accelerator(cpu=True))
    batch["task"] = ["t"] * 32
    for _ in range(3):
        m_whole, m_pieces = a_whole.update(batch, 1e-2), a_pieces.update(batch, 1e-2)
        assert m_pieces["micro_batches"] == 4 and "micro_batches" not in m_whole
        assert abs(m_whole["bc_loss"] - m_pieces["bc_loss"]) < 1e-5 * m_whole["bc_loss"]
        assert abs(m_whole["grad_norm"] - m_pieces["grad_norm"]) < 1e-5 * m_whole["grad_norm"]
    for (k, p), q in zip(whole.named_parameters(), pieces.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=k)
    with pytest.raises(ValueError, match="micro_batch_size"):
        RejectionSamplingConfig(micro_batch_size=0).validate()
    # windows from the replay: the MLP learner samples [B, 3, A] with step_mask
    builder, data, learner, spec, steps = build(tmp_path, rs_cfg(eval_episodes=0))
    assert learner.horizon == 1
    data.close()


# -- the scripted expert and the demo recorder -------------------------------------------------------
def make_point_reach(**kw):
    from envs.intervention import ExpertIntervention, InterventionWrapper
    from envs.registry import make_env

    src = ExpertIntervention(**kw)
    env = make_env({"name": "point_reach", "num_tasks": 1, "max_episode_steps": 20}, intervention=src)
    return src.bind(env), src, InterventionWrapper


def test_expert_takes_over_on_drift_watches_n_episodes_and_skips_jobs():
    env, src, _ = make_point_reach(episodes=2, trigger="drift", drift_steps=2, drift_threshold=0.5)
    away = lambda: -env.unwrapped.expert_action()  # noqa: E731 - a policy heading away
    env.reset(seed=0)
    flags = []
    for _ in range(6):
        _, _, term, trunc, info = env.step(away())
        flags.append(info["intervened"])
        if term or trunc:
            break
    assert flags[:3] == [False, True, True] and src.takeovers == 1
    assert info["is_success"] or all(flags[1:])                  # it drives to the end
    env.reset(seed=1, options={"task_id": 0, "init_state": 3})  # a learner job: hands off
    assert not any(env.step(away())[4]["intervened"] for _ in range(3))
    env.reset(seed=2)                                            # 2nd watched episode
    env.step(away())
    assert env.step(away())[4]["intervened"]
    env.reset(seed=3)                                            # past episodes=2: hands off
    assert not any(env.step(away())[4]["intervened"] for _ in range(3))
    assert src.episodes_watched == 2
    # a good policy is never corrected; "step" takes over at start_step for hold_steps
    env, src, _ = make_point_reach(trigger="drift")
    env.reset(seed=4)
    info = env.step(env.unwrapped.expert_action())[4]
    assert not info["intervened"] and src.takeovers == 0
    env, src, _ = make_point_reach(trigger="step", start_step=1, hold_steps=1)
    env.reset(seed=5)
    got = [env.step(np.zeros(2, np.float32))[4]["intervened"] for _ in range(4)]
    assert got == [False, True, False, False]
    with pytest.raises(ValueError, match="expert_action"):
        from envs.intervention import ExpertIntervention
        from envs.registry import make_env

        ExpertIntervention().bind(make_env({"name": "reacher"}))


def test_record_demos_writes_a_dataset_the_learner_loads_as_demos(tmp_path):
    from data.demos import load_demos
    from envs.registry import env_spec
    from tools.record_demos import env_config, record_demos

    cfg = env_config(["env=point_reach", "env.num_tasks=1", "~env.cameras", "+env.cameras={}",
                      "env.state_has_target=true"])
    summary = record_demos(cfg, tmp_path / "d", 3, seed=7)
    assert summary["episodes"] == 3 and summary["successes"] == 3
    spec = env_spec(cfg).with_extras(registry.build_policy(POLICY, env_spec(cfg)).extras_spec())
    buf = load_demos(tmp_path / "d", spec)
    assert len(buf) == summary["frames"] - 3
    b = buf.sample(64)
    assert (b["policy_version"] == -1).all() and not b["intervened"].any()
    assert buf.count(lambda r: r.episode_success) == len(buf)  # every demo episode succeeded
    with pytest.raises(FileExistsError):
        record_demos(cfg, tmp_path / "d", 1)
