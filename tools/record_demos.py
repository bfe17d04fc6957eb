"""Record scripted expert episodes of an env as a LeRobot dataset, usable as ``buffer.demos``.

The env must offer a scripted demonstrator, ``env.unwrapped.expert_action()`` (e.g.
``env=point_reach``). The env is built exactly as the actor builds it (``config/actor.yaml``
with the same Hydra overrides, so the demos fit the learner's spec), episodes are recorded
as the actor records them (one record per step plus the final ``is_last`` observation,
``policy_version`` -1) and written through :class:`data.store.EpisodeStore`, one durable
commit for all of them::

    python -m tools.record_demos --out demos/point_reach --episodes 5 env=point_reach \\
        env.num_tasks=1 env.randomize_targets=true
    python -m learner algo=rejection_sampling env=point_reach ... buffer.demos=demos/point_reach

Try ``j`` resets with ``seed + j`` (``--per-task``: try ``j`` of task ``t`` with
``seed + 10_000 * t + j``); set ``--seed`` apart from the learner's evaluation init states to
keep the demos off them (LIBERO: ``env.init_state_id=random`` starts every demo from a
placement of LIBERO's own sampler, none of the 50 fixed evaluation states). ``--noise`` adds
N(0, noise^2) to the expert's actions (a less precise demonstrator); ``--only-success`` keeps
only the episodes the expert solved (and records more until there are ``--episodes`` of them).
``--per-task`` records ``--episodes`` of each task of a multi-task env, the tasks spread over
``--workers`` processes::

    python -m tools.record_demos --out demos/spatial10 --episodes 10 --per-task --only-success \
        --workers 10 env=libero_spatial env.task_id=all env.init_state_id=random env.image_size=64
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger("tandem.tools.record_demos")


def env_config(overrides: Sequence[str]):
    """The actor's env config section with Hydra ``overrides`` (``env=point_reach``, ...)."""
    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1] / "config"
    with initialize_config_dir(config_dir=str(root), version_base=None):
        return compose(config_name="actor", overrides=list(overrides)).env


def expert_of(env):
    fn = getattr(env.unwrapped, "expert_action", None)
    if fn is None:
        raise ValueError(f"env {type(env.unwrapped).__name__} has no scripted demonstrator "
                         "(env.unwrapped.expert_action())")
    return fn


def run_episode(env, episode: int, seed: int, *, noise: float = 0.0,
                rng: np.random.Generator | None = None, options: dict | None = None) -> tuple[list[dict], bool]:
    """One expert episode as actor-style records (the last one ``is_last``) and its outcome."""
    from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK

    expert = expert_of(env)
    rng = rng or np.random.default_rng(seed)
    records: list[dict] = []

    def record(obs, **step):
        rec = {k: np.asarray(v, np.uint8) for k, v in obs.items() if k.startswith(OBS_IMAGE_PREFIX)}
        rec[OBS_STATE] = np.asarray(obs[OBS_STATE], np.float32)
        rec[TASK] = str(obs.get(TASK, ""))
        rec.update(step)
        records.append(rec)

    obs, _ = env.reset(seed=seed, options=options)
    t, success = 0, False
    while True:
        a = np.asarray(expert(), np.float32)
        if noise:
            a = np.clip(a + rng.normal(0.0, noise, a.shape), -1.0, 1.0).astype(np.float32)
        nxt, reward, terminated, truncated, info = env.step(a)
        success = bool(info.get("is_success", False))
        record(obs, action=a, reward=np.float32(reward), terminated=bool(terminated),
               truncated=bool(truncated), intervened=False, is_last=False, success=success,
               policy_version=-1, episode=episode, step=t, chunk_start=True, chunk_index=0,
               group_id=-1)
        obs, t = nxt, t + 1
        if terminated or truncated:
            break
    record(obs, action=np.zeros_like(a), reward=np.float32(0.0), terminated=False,
           truncated=False, intervened=False, is_last=True, success=success, policy_version=-1,
           episode=episode, step=t, chunk_start=False, chunk_index=0, group_id=-1)
    return records, success


def collect(env_cfg, tasks: Sequence[int | None], episodes: int, *, seed: int, noise: float = 0.0,
            only_success: bool = False, max_tries: int | None = None) -> list[tuple[int | None, list[dict], bool]]:
    """Expert episodes of ``env_cfg``: ``episodes`` of each task in ``tasks`` (None: the env's
    own choice), task by task (one scene build each). The ``j``-th try of task ``t`` resets with
    ``seed + 10_000 * (t or 0) + j``, so what a task records does not depend on which process
    ran it. A task stops after ``max_tries`` tries (None: an error after ``10 * episodes + 10``)
    with what it has. Returns ``(task, records, solved)`` for every try (records empty for a
    try not kept)."""
    from envs.registry import make_env

    env = make_env(env_cfg)
    out: list[tuple[int | None, list[dict], bool]] = []
    try:
        for task in tasks:
            kept = tried = 0
            rng = np.random.default_rng(seed + 10_000 * (task or 0))
            while kept < episodes:
                if max_tries is not None and tried >= max_tries:
                    log.warning("task %s: the expert solved %d of %d tries; keeping those", task, kept, tried)
                    break
                if tried >= 10 * episodes + 10:
                    raise RuntimeError(f"the expert solved only {kept} of {tried} episodes of task {task}")
                options = None if task is None else {"task_id": int(task)}
                records, ok = run_episode(env, 0, seed + 10_000 * (task or 0) + tried, noise=noise, rng=rng,
                                          options=options)
                tried += 1
                if only_success and not ok:
                    out.append((task, [], False))
                    continue
                kept += 1
                out.append((task, records, ok))
    finally:
        env.close()
    return out


def _collect_star(args):
    return collect(*args[:3], **args[3])


def record_demos(env_cfg, out: str | Path, episodes: int, *, seed: int = 1000, noise: float = 0.0,
                 only_success: bool = False, video: bool = False, fps: int = 10,
                 actor_id: str = "expert", per_task: bool = False, workers: int = 1,
                 max_tries: int | None = None) -> dict:
    """Write ``episodes`` expert episodes of ``env_cfg`` to a new LeRobot dataset at ``out``
    (``per_task``: ``episodes`` of each of the env's tasks, ``reset(options={"task_id": t})``,
    the tasks spread over ``workers`` processes); returns a summary (episodes, frames,
    successes, tried, per task)."""
    import multiprocessing as mp

    from data.store import Episode, EpisodeStore
    from data.core.transitions import TransitionBatch
    from envs.registry import env_spec

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    spec = env_spec(env_cfg)
    tasks: list[int | None] = [None]
    if per_task:
        from envs.registry import make_env

        probe = make_env(env_cfg)   # the task list only (LIBERO builds no scene before reset)
        tasks = list(getattr(probe.unwrapped, "task_ids", None) or [None])
        probe.close()
    kw = dict(seed=seed, noise=noise, only_success=only_success, max_tries=max_tries)
    if workers > 1 and len(tasks) > 1:
        groups = [tasks[i::workers] for i in range(min(workers, len(tasks)))]
        with mp.get_context("spawn").Pool(len(groups)) as pool:
            parts = pool.map(_collect_star, [(env_cfg, g, episodes, kw) for g in groups], chunksize=1)
        got = sorted((x for part in parts for x in part), key=lambda x: tasks.index(x[0]))
    else:
        got = collect(env_cfg, tasks, episodes, **kw)
    eps: list[Episode] = []
    seq = 0
    for task, records, _ in got:
        if not records:
            continue
        for r in records:
            r["episode"] = len(eps)
        batch = TransitionBatch.from_records(actor_id, seq, records)
        seq += len(batch)
        eps.append(Episode.from_batch(batch))
    store = EpisodeStore(out, spec, fps=fps, video=video)
    try:
        done, dropped = store.write(eps)
    finally:
        store.close()
    if dropped:
        raise RuntimeError(f"{len(dropped)} episode(s) could not be written")
    tried, wins = len(got), sum(ok for _, _, ok in got)
    summary = {"dataset": str(out), "episodes": len(done), "frames": sum(len(e) for e in done),
               "successes": sum(bool(e.arrays["success"][-1]) for e in done), "tried": tried,
               "expert_success_rate": wins / max(tried, 1)}
    if per_task:
        summary["per_task"] = {str(t): sum(1 for tt, r, _ in got if tt == t and r) for t in tasks}
    log.info("recorded %s", summary)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the new dataset's directory")
    p.add_argument("--episodes", type=int, default=5)
    p.add_argument("--per-task", action="store_true",
                   help="--episodes of each of the env's tasks (env.task_id=all: every task of the suite)")
    p.add_argument("--workers", type=int, default=1, help="processes (--per-task: tasks spread over them)")
    p.add_argument("--max-tries", type=int, default=None,
                   help="give up on a task after this many tries, keeping what it has (default: error)")
    p.add_argument("--seed", type=int, default=1000,
                   help="try j resets with seed + j (--per-task: seed + 10000 * task + j)")
    p.add_argument("--noise", type=float, default=0.0, help="std of Gaussian action noise")
    p.add_argument("--only-success", action="store_true", help="keep only solved episodes")
    p.add_argument("--video", action="store_true", help="cameras as AV1 video (default: PNG)")
    p.add_argument("--fps", type=int, default=10)
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the actor config, e.g. env=point_reach")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = record_demos(env_config(args.overrides), args.out, args.episodes, seed=args.seed,
                           noise=args.noise, only_success=args.only_success, video=args.video,
                           fps=args.fps, per_task=args.per_task, workers=args.workers,
                           max_tries=args.max_tries)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
