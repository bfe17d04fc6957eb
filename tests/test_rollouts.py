"""On-policy data and cadence: the rollout queue (assembly, staleness, groups, bounds), action
chunks of episodes, GAE over chunks, the GRPO job source and round collector, builders and
their start-up checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from tandem_testutil import ROOT

A = 2


def records(episode, n, *, version=0, group=-1, H=1, success=False, truncated=False,
            human=(), reward=1.0, lp0=0.0):
    """n steps of one episode plus its is_last record; chunks of H from step 0, a human
    driving the steps in ``human`` (the policy restarts a chunk after them)."""
    recs, ci = [], 0
    for t in range(n):
        h = t in human
        start = not h and (ci == 0 or ci >= H)
        if start or ci >= H:
            ci = 0
        recs.append({"observation.state": np.full(3, t, np.float32), "task": f"task{group}",
                     "action": np.full(A, t / 10, np.float32), "reward": reward,
                     "terminated": t == n - 1 and not truncated,
                     "truncated": t == n - 1 and truncated, "intervened": h, "is_last": False,
                     "success": success and t == n - 1, "policy_version": version,
                     "episode": episode, "step": t, "chunk_start": start, "chunk_index": ci,
                     "group_id": group, "extra.log_prob": np.float32(lp0 + t)})
        ci = 0 if h else ci + 1
    recs.append({**recs[-1], "observation.state": np.full(3, n, np.float32), "action": np.zeros(A, np.float32),
                 "reward": 0.0, "terminated": False, "truncated": False, "intervened": False,
                 "is_last": True, "step": n, "chunk_start": False, "chunk_index": 0,
                 "success": success, "extra.log_prob": np.float32(0)})
    return recs


def batch(actor, seq, recs):
    from data.core.transitions import TransitionBatch

    return TransitionBatch.from_records(actor, seq, recs)


def test_queue_assembles_episodes_across_batches_and_actors():
    from data.rollouts import RolloutQueue

    q = RolloutQueue()
    seen = []
    q.on_finished.append(seen.append)
    a = records(0, 5, version=3, group=7, success=True)
    b = records(4, 3, version=2)
    a[2]["policy_version"] = 2
    q.add(batch("a", 0, a[:2]))
    q.add(batch("b", 0, b[:2]))
    assert len(q) == 0 and q.status()["open_episodes"] == 2
    q.add(batch("a", 2, a[2:]))
    q.add(batch("b", 2, b[2:]))
    assert len(q) == 2 and [e.key for e in seen] == [("a", 0), ("b", 4)]
    ep = seen[0]
    assert ep.group_id == 7 and (ep.min_version, ep.max_version) == (2, 3)
    assert ep.success and ep.ret == 5.0 and ep.length == 5 and ep.task == "task7"
    assert len(ep.tasks) == 6 and ep.arrays["is_last"][-1] and ep.arrays["extra.log_prob"].shape == (6,)
    np.testing.assert_array_equal(ep.arrays["step"], np.arange(6))
    assert q.total_added == 10


def test_abandoned_and_unfinished_episodes_are_dropped_and_reported():
    from data.rollouts import RolloutQueue

    q = RolloutQueue(max_open=2)
    gone = []
    q.on_abandoned.append(lambda actor, ep: gone.append((actor, ep)))
    q.add(batch("a", 0, records(0, 4)[:2]))
    q.abandon("a", 0)
    q.add(batch("a", 2, records(1, 4)[:2]))
    q.add(batch("a", 4, records(2, 2)))  # the actor moved on from episode 1
    assert gone == [("a", 0), ("a", 1)] and len(q) == 1
    for i, actor in enumerate("xyz"):  # more open episodes than max_open: the oldest goes
        q.add(batch(actor, 0, records(0, 3)[:1]))
    assert ("x", 0) in gone and q.status()["open_episodes"] == 2
    assert q.status()["abandoned"] == 2 and q.status()["dropped_open"] == 1


def test_take_drops_stale_episodes_and_the_queue_is_bounded():
    from data.rollouts import RolloutQueue

    q = RolloutQueue(max_episodes=3, max_staleness=1)
    for ep, v in enumerate([0, 1, 2, 3]):
        q.add(batch("a", 10 * ep, records(ep, 2, version=v)))
    assert len(q) == 3 and q.counters["dropped_overflow"] == 1  # episode 0 went
    got = q.take(5, current_version=3)  # version 1 is 2 behind: stale
    assert [e.episode for e in got] == [2, 3] and q.counters["dropped_stale"] == 1
    assert q.take(1, current_version=3) == [] and len(q) == 0


def test_take_groups_whole_groups_surplus_stale_and_prune():
    from data.rollouts import RolloutQueue

    q = RolloutQueue(max_staleness=0)
    eps = [(5, 1), (6, 1), (5, 1), (6, 1), (5, 1), (6, 0), (9, 1), (-1, 1)]
    for i, (g, v) in enumerate(eps):
        q.add(batch("a", 10 * i, records(i, 2, version=v, group=g)))
    assert q.group_counts(current_version=1) == {5: 3, 6: 2, 9: 1}
    assert q.take_groups(3, current_version=1, groups=[6, 9]) == []
    got = q.take_groups(2, current_version=1)  # group 5 (3: one surplus) and 6 (the stale one dropped)
    assert [[e.episode for e in g] for g in got] == [[0, 2], [1, 3]]
    assert q.counters["dropped_surplus"] == 1 and q.counters["dropped_stale"] == 1
    assert q.take_groups(2, current_version=1, min_size=1, groups=[9])[0][0].episode == 6
    assert q.prune(lambda e: e.group_id >= 0, "ungrouped") == 1 and len(q) == 0


def test_episode_chunks_policy_mask_rewards_and_discounts():
    from data.rollouts import RolloutEpisode, episode_chunks

    # 9 steps, H = 3: chunks at 0, 3; a human drives 4-5; the policy restarts at 6 (6, 7, 8)
    recs = records(0, 9, H=3, human=(4, 5), truncated=True, lp0=10.0)
    for i, r in enumerate(recs[:-1]):
        r["reward"] = float(i)
    ep = RolloutEpisode.from_arrays("a", 0, batch("a", 0, recs).arrays, [r["task"] for r in recs])
    ch = episode_chunks(ep, 3, gamma=0.9)
    assert ch.obs_index.tolist() == [0, 3, 6] and ch.next_index.tolist() == [3, 6, 9]
    assert ch.steps.tolist() == [3, 3, 3]
    assert ch.reward.tolist() == [3.0, 12.0, 21.0]
    np.testing.assert_allclose(ch.discount, [0.9, 0.9, 0.9])
    assert ch.intervened.tolist() == [False, True, False]
    assert ch.policy_mask.tolist() == [True, False, True]
    assert ch.truncated.tolist() == [False, False, True] and not ch.terminated.any()
    np.testing.assert_allclose(ch.behaviour_log_prob, [10.0, 13.0, 16.0])
    # an episode ending inside a chunk: the last chunk is padded with its last action, masked
    ep2 = RolloutEpisode.from_arrays("a", 1, batch("a", 0, records(1, 5, H=3)).arrays, [""] * 6)
    ch2 = episode_chunks(ep2, 3, gamma=0.9)
    assert ch2.steps.tolist() == [3, 2] and ch2.policy_mask.tolist() == [True, False]
    np.testing.assert_allclose(ch2.action[1], [[0.3, 0.3], [0.4, 0.4], [0.4, 0.4]])
    np.testing.assert_allclose(ch2.discount, [0.9, 0.9 ** (2 / 3)], rtol=1e-6)
    assert ch2.terminated.tolist() == [False, True]


def test_gae_over_chunk_batches_matches_a_hand_loop():
    from agents.ppo.on_policy import chunk_batch, gae_advantages, ppo_batch
    from data.rollouts import RolloutEpisode

    rng = np.random.default_rng(0)
    eps = []
    for i, (n, trunc) in enumerate([(4, False), (6, True), (1, False)]):
        recs = records(i, n, truncated=trunc)
        for r in recs[:-1]:
            r["reward"] = float(rng.normal())
        eps.append(RolloutEpisode.from_arrays("a", i, batch("a", 0, recs).arrays, [""] * (n + 1)))
    cb = chunk_batch(eps, horizon=1, gamma=0.9)
    assert len(cb) == 11 and cb.lengths == [4, 6, 1] and cb.obs["observation.state"].shape == (11, 3)
    values = torch.randn(len(cb))
    finals = torch.randn(3)
    gamma, lam = 0.9, 0.8
    adv, ret = gae_advantages(cb, values, finals, gamma, lam)
    want, k = [], 0
    for b, ep in enumerate(eps):
        n = cb.lengths[b]
        v = values[k:k + n].tolist() + [finals[b].item()]
        r = cb.reward[k:k + n].tolist()
        term = bool(ep.arrays["terminated"][n - 1])
        a, out = 0.0, []
        for t in reversed(range(n)):
            boot = 0.0 if (t == n - 1 and term) else v[t + 1]
            a = r[t] + gamma * boot - v[t] + (gamma * lam * a if t < n - 1 else 0.0)
            out.append(a)
        want += out[::-1]
        k += n
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), (adv + values).numpy(), rtol=1e-6)
    # irregular chunks: with lam = 0 every TD error uses the chunk's own discount
    recs = records(0, 7, H=3, human=(3,), truncated=True)
    ep = RolloutEpisode.from_arrays("a", 0, batch("a", 0, recs).arrays, [""] * 8)
    cb = chunk_batch([ep], horizon=3, gamma=0.9)
    values, finals = torch.randn(len(cb)), torch.randn(1)
    adv, _ = gae_advantages(cb, values, finals, 0.9, 0.0)
    nxt = torch.cat([values[1:], finals])
    np.testing.assert_allclose(adv.numpy(), (cb.reward + cb.discount * nxt - values).numpy(), rtol=1e-5)
    assert cb.discount.tolist() != [cb.discount[0].item()] * len(cb)  # the human's step is 1/3 chunk
    # each chunk's executed steps ride in PPO's batch (token ratios of unexecuted actions are masked)
    assert int(cb.steps.sum()) == 7 and cb.steps.min() >= 1 and not cb.own_mask[0]  # the human's chunk
    np.testing.assert_allclose(cb.discount.numpy(), 0.9 ** (cb.steps.numpy() / 3), rtol=1e-6)
    assert torch.equal(ppo_batch(cb, adv)["chunk_steps"], cb.steps)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def grpo_cfg(**kw):
    from agents.grpo.config import GRPOBuilderConfig

    base = dict(group_size=2, batch_groups=2, task_ids=(0, 1), num_init_states=5,
                job_timeout_s=10.0, round_timeout_s=100.0, prefetch_rounds=1)
    base.update(kw)
    return GRPOBuilderConfig(**base)


def test_group_job_source_issues_groups_and_reissues_lost_jobs():
    from agents.grpo.jobs import GroupJobSource
    from data.rollouts import RolloutEpisode

    clock = Clock()
    src = GroupJobSource(grpo_cfg(), clock=clock)
    jobs = [src.next_job("a", i) for i in range(4)]
    assert src.next_job("a", 1) == jobs[1]  # asking again: the same job
    assert [j.group_id for j in jobs] == [0, 0, 1, 1] and [j.task_id for j in jobs] == [0, 0, 1, 1]
    assert jobs[0].init_state == jobs[1].init_state and jobs[0].seed != jobs[1].seed
    more = [src.next_job("b", i) for i in range(4)]  # the prefetched round
    assert {j.group_id for j in more} == {2, 3} and src.next_job("b", 9) is None  # two rounds open

    def finish(actor, ep, job, group=None):
        recs = records(ep, 2, group=job.group_id if group is None else group)
        src.episode_finished(RolloutEpisode.from_arrays(actor, ep, batch(actor, 0, recs).arrays,
                                                        [""] * 3))

    finish("a", 0, jobs[0])
    finish("a", 1, jobs[1], group=-1)  # the actor never got the job: it goes out again
    clock.t = 5.0
    assert src.next_job("c", 0) == jobs[1]
    src.episode_abandoned("a", 2)  # abandoned: out again
    assert src.next_job("c", 1) == jobs[2]
    clock.t = 11.0  # job 3 (actor a, episode 3) and the prefetched ones are overdue
    assert src.next_job("c", 2) == jobs[3]
    assert src.counters["reissued"] == 2 + 1 + 4
    finish("a", 3, jobs[3])  # the first holder finishes after all: the job is done once
    assert src.status()["done"] == 2
    rnd = src.current_round()
    assert rnd.round_id == 0 and rnd.groups == [0, 1]
    src.close_round(0)
    assert src.open_groups() == {2, 3}
    state = src.state_dict()
    src2 = GroupJobSource(grpo_cfg(), clock=clock)
    src2.load_state_dict(state)
    assert src2.next_job("z", 0).group_id == 4  # ids never repeat across a restart


def test_group_rounds_complete_timeout_and_dynamic_sampling():
    from agents.grpo.jobs import GroupJobSource, GroupRounds
    from data.rollouts import RolloutQueue

    clock = Clock()
    cfg = grpo_cfg(prefetch_rounds=0, max_staleness=0)
    src = GroupJobSource(cfg, clock=clock)
    q = RolloutQueue(max_staleness=0)
    q.on_finished.append(src.episode_finished)
    rounds = GroupRounds(q, src, cfg, horizon=1, clock=clock)
    assert rounds.collect(0) is None  # no round yet
    seq = 0

    def run(actor, ep, success, group=None, version=0):
        nonlocal seq
        job = src.next_job(actor, ep)
        recs = records(ep, 3, group=job.group_id if group is None else group, success=success,
                       version=version)
        q.add(batch(actor, seq, recs))
        seq += len(recs)
        return job

    run("a", 0, True)
    run("a", 1, False)
    run("a", 2, True)
    assert rounds.collect(0) is None  # group 1 has one episode
    run("b", 0, True, group=-1)  # runs without the job: dropped, and the job goes out again
    assert rounds.collect(0) is None and q.counters["dropped_ungrouped"] == 1
    run("a", 3, False)
    got = rounds.collect(0)
    assert got.metrics["round_episodes"] == 4 and got.metrics["round_timed_out"] == 0
    b = got.batch
    assert b["advantages"].shape == (12,) and b["action"].shape == (12, 1, A)
    assert (b["advantages"][:3] > 0).all() and (b["advantages"][3:6] < 0).all()
    assert b["mask"].all() and b["old_log_prob"].shape == (12,)
    assert src.next_job("a", 4) is None  # the next round is issued once the update is done
    got.done()
    # next round (learner at version 1): group 2 all failures (dropped by dynamic sampling),
    # one of its episodes stale, so that job runs again; group 3 never completes
    run("a", 4, False, version=1)
    run("a", 5, False, version=0)
    assert rounds.collect(1) is None and src.counters["rerun"] == 1
    run("a", 6, False, version=1)  # the rerun
    run("a", 7, False, version=1)  # group 3's first
    clock.t = 101.0
    got = rounds.collect(1)
    assert got.batch is None and got.metrics["round_timed_out"] == 1
    assert got.metrics["round_dynamic_dropped_groups"] == 1 and got.metrics["round_episodes"] == 2
    got.done()
    assert src.current_round() is None and q.counters["dropped_stale"] == 1


def test_yaml_configs_document_every_field_and_bad_pairs_fail_at_start_up():
    import dataclasses

    from agents import registry

    for algo in ("ppo", "grpo"):
        values = yaml.safe_load((ROOT / "config" / "algo" / f"{algo}.yaml").read_text())
        builder = registry.build_builder(values)
        fields = {f.name for f in dataclasses.fields(builder.cfg)}
        assert fields == set(values) - {"name"}, (algo, fields ^ set(values))
        with pytest.raises(ValueError, match="LogProbPolicy"):
            registry.check_algo_policy(values, "pi0")
    with pytest.raises(ValueError, match="group estimators"):
        registry.build_builder({"name": "ppo", "estimator": "grpo"})
    with pytest.raises(ValueError, match="max_staleness"):
        registry.build_builder({"name": "grpo", "max_staleness": 0, "prefetch_rounds": 1})


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_ppo_builder_rounds_update_and_publish(estimator, tmp_path):
    from accelerate import Accelerator

    from agents import registry
    from agents.common.value import ValueNet
    from data.core.spec import EnvSpec

    spec0 = EnvSpec(state_dim=3, action_dim=A)
    policy = registry.build_policy({"name": "mlp", "hidden_dims": [16]}, spec0)
    spec = spec0.with_extras({"log_prob": ("float32", ())})
    builder = registry.build_builder({"name": "ppo", "estimator": estimator, "batch_episodes": 3,
                                      "minibatch_size": 4, "epochs": 2})
    nets = builder.make_networks(spec, policy, torch.device("cpu"))
    assert isinstance(nets.value, ValueNet) == (estimator == "gae")
    data = builder.make_data(spec, {"persist": False}, run_dir=tmp_path, seed=0, device="cpu", train=True)
    learner = builder.make_learner(nets, data, Accelerator(cpu=True), env_steps=lambda: 0)
    assert builder.jobs() is None and data.store is None
    for i in range(2):
        data.sink.add(batch("a", 10 * i, records(i, 4)))
    assert learner.step() is None and not learner.should_publish()
    data.sink.add(batch("a", 30, records(2, 5, truncated=True)))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    m = learner.step()
    assert m["round_episodes"] == 3 and m["round_chunks"] == 13 and learner.should_publish()
    assert learner.version == 1 and learner.updates == 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    state = learner.state_dict()
    learner.load_state_dict(state)
    assert learner.version == 1


def test_remax_groups_get_a_greedy_baseline_job():
    from agents.grpo.jobs import GroupJobSource, GroupRounds
    from data.rollouts import RolloutQueue

    cfg = grpo_cfg(estimator="remax", batch_groups=1, prefetch_rounds=0, max_staleness=0)
    src = GroupJobSource(cfg)
    q = RolloutQueue(max_staleness=0)
    q.on_finished.append(src.episode_finished)
    rounds = GroupRounds(q, src, cfg, horizon=1)
    jobs = [src.next_job("a", i) for i in range(3)]
    assert [j.deterministic for j in jobs] == [False, False, True] and src.next_job("a", 3) is None
    for i, (job, ok) in enumerate(zip(jobs, [True, False, True])):  # the greedy one succeeds
        q.add(batch("a", 10 * i, records(i, 2, group=job.group_id, success=ok)))
    got = rounds.collect(0)
    assert got.metrics["round_episodes"] == 2  # the greedy episode is the baseline, not trained on
    np.testing.assert_allclose(got.batch["advantages"], [0.0, 0.0, -1.0, -1.0])


@pytest.mark.parametrize("loss_agg", ["chunk_mean", "episode_mean"])
def test_ppo_rounds_weigh_episodes_alike_with_episode_mean(loss_agg, tmp_path):
    """algo=ppo loss_agg=episode_mean: each chunk's weight is 1 / its episode's chunk count (scaled
    to a chunk mean of 1), so a 1-chunk success counts as much as a 4-chunk failure."""
    from agents import registry
    from agents.ppo.on_policy import EpisodeRounds
    from agents.common.value import ValueNet
    from data.core.spec import EnvSpec
    from data.rollouts import RolloutQueue

    with pytest.raises(ValueError, match="loss_agg"):
        registry.build_builder({"name": "ppo", "loss_agg": "token_sum"})
    spec = EnvSpec(state_dim=3, action_dim=A)
    q = RolloutQueue()
    rounds = EpisodeRounds(q, batch_episodes=2, horizon=1, gamma=0.99, lam=0.95, estimator="gae",
                           value_fn=ValueNet(registry.build_builder({"name": "ppo"}).cfg.value_net_config(), spec),
                           episode_mean=loss_agg == "episode_mean")
    q.add(batch("a", 0, records(0, 1, success=True)))
    q.add(batch("a", 10, records(1, 4)))
    b = rounds.collect(0).batch
    if loss_agg == "chunk_mean":
        assert "chunk_weight" not in b
        return
    w = b["chunk_weight"]
    assert w.shape == (5,) and torch.isclose(w.mean(), torch.tensor(1.0))
    assert torch.isclose(w[0], 4 * w[1]) and torch.allclose(w[1:], w[1:2].expand(4))
