"""Tandem's replay buffer and episode store side by side with lerobot's RL ReplayBuffer.

    python -m tools.bench.buffer                  # figures and ratios
    python -m tools.bench.buffer --json           # one JSON object (memory_ratio, sample_ratio, ...)

Both are fed the same transitions: 2 cameras 128x128 + state (8) + action (4), episodes of
``--episode-len`` steps ending in truncation, camera-like images (smooth scene, moving
objects, a little sensor noise). Measured, for each:

- memory per transition (bytes): the storage each buffer holds for its transitions, divided
  by the number of sampleable transitions (Tandem: uint8 images, each observation stored
  once, plus one final observation per episode; lerobot: float32 images, built as its learner
  builds it, ``optimize_memory=True``: each state stored once, next state read from the next
  row);
- add rate (transitions/s): Tandem adds wire batches of ``--add-batch`` records; lerobot
  adds one transition per call (its API), with inputs prepared beforehand for both;
- sample(256) rate (batches/s): lerobot without its DrQ augmentation (``--drq`` adds it),
  so both measure sampling itself; Tandem returns uint8 images, lerobot float32;
- episode write rate to disk (episodes/s): Tandem commits each episode durably (its own
  commit, fsynced) into a LeRobot dataset through lerobot's writer; lerobot's buffer writes
  the same episodes with ``to_lerobot_dataset`` (one pass, no fsync). Both encode video.

Ratios are Tandem / lerobot: ``memory_ratio`` (lower is better), ``sample_ratio``,
``add_ratio`` and ``write_ratio`` (higher is better).

The episode writer under a burst (``writer``; ``--writer-only`` runs just this part): the
learner's episode store, fed ``--writer-episodes`` short episodes (``--writer-len`` steps,
2 cameras 128x128) at once through ``submit`` as ingest does, timed until the last one is
durable (committed and fsynced: when the learner acks it), for the store's default encoder
(``pool``: worker processes encode H.264 from memory, the writer thread appends) and for
today's method before it (``lerobot``: lerobot's add_frame / save_episode, PNG staging and
AV1, on the writer thread), in the same run. ``writer_ratio`` = pool / lerobot episodes/s;
``bytes_per_episode`` is the dataset's video bytes per episode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data.replay import ReplayBuffer
from data.core.transitions import TransitionBatch
from tools.bench.common import bench_spec, emit_json, episode_flags, quiet_logging, rate

CAMS = ("front", "wrist")
H = W = 128
S, A = 8, 4


def camera_like(rng: np.random.Generator, episodes: int, length: int, noise: float) -> np.ndarray:
    """[episodes, length + 1, cams, H, W, 3] uint8: smooth background, two moving objects."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float32)
    out = np.empty((episodes, length + 1, len(CAMS), H, W, 3), np.uint8)
    for e in range(episodes):
        phase = rng.uniform(0, 6.28, 4)
        for c in range(len(CAMS)):
            base = np.stack([90 + 40 * np.sin(x / 23 + phase[c]), 80 + 30 * np.cos(y / 19),
                             np.full_like(x, 110 + 20 * c)], -1)
            for t in range(length + 1):
                img = base.copy()
                cx, cy = 64 + 35 * np.sin(t / 9 + phase[2]), 64 + 35 * np.cos(t / 11 + phase[3])
                img[(x - cx) ** 2 + (y - cy) ** 2 < 14 ** 2] = (200, 60, 40)
                img[90:104, (t * 2) % 100:(t * 2) % 100 + 20] = (40, 180, 60)
                img += rng.normal(0, noise, img.shape).astype(np.float32)
                out[e, t, c] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def make_episodes(n_episodes: int, length: int, seed: int, noise: float):
    rng = np.random.default_rng(seed)
    images = camera_like(rng, n_episodes, length, noise)
    eps = []
    for e in range(n_episodes):
        m = length + 1
        arrays = {
            "observation.state": rng.standard_normal((m, S)).astype(np.float32),
            "action": rng.uniform(-1, 1, (m, A)).astype(np.float32),
            "reward": rng.standard_normal(m).astype(np.float32),
            **episode_flags(m, e),  # the last step truncated, then the is_last record
        }
        arrays["action"][length] = 0
        for c, cam in enumerate(CAMS):
            arrays[f"observation.images.{cam}"] = images[e, :, c]
        eps.append(arrays)
    return eps


# ---- Tandem -------------------------------------------------------------------------------------


def bench_tandem(eps, spec, args) -> dict:
    n_trans = sum(len(e["reward"]) - 1 for e in eps)
    n_rec = sum(len(e["reward"]) for e in eps)
    batches, seq = [], 0
    for e in eps:
        m = len(e["reward"])
        for i in range(0, m, args.add_batch):
            j = min(m, i + args.add_batch)
            batches.append(TransitionBatch("bench", seq + i, {k: v[i:j] for k, v in e.items()},
                                           ["bench task"] * (j - i)))
        seq += m
    rb = ReplayBuffer(n_rec, spec, seed=0, image_codec=args.codec)
    args.codec = rb.image_codec  # auto resolved
    t = time.perf_counter()
    for b in batches:
        rb.add(b)
    add_rate = n_trans / (time.perf_counter() - t)
    assert len(rb) == n_trans, (len(rb), n_trans)
    res = {"memory_per_transition": rb.nbytes / len(rb), "add_per_s": add_rate,
           "sample256_per_s": rate(lambda: rb.sample(256), args.sample_iters)}
    rb.close()
    return res


def bench_tandem_write(eps, spec, args, root: Path) -> dict:
    from data.store import Episode, EpisodeStore

    store = EpisodeStore(root / "tandem", spec, video=not args.images, fps=10, encoder="pool",
                         encode_workers=0)
    todo = [Episode("bench", i, e, ["bench task"] * len(e["reward"]),
                    np.arange(len(e["reward"]), dtype=np.int64)) for i, e in enumerate(eps)]
    store.write(todo[:1])  # warm-up (encoder start-up), not timed
    t = time.perf_counter()
    for ep in todo[1:]:
        store.write([ep])  # one durable commit per episode
    dt = time.perf_counter() - t
    frames = sum(len(e) for e in todo[1:])
    return {"write_episodes_per_s": (len(todo) - 1) / dt, "write_frames_per_s": frames / dt}


def bench_writer(eps, spec, root: Path, encoder: str, warmup: int = 2) -> dict:
    """Episodes/s of the episode store draining a burst (submit all, wait until durable)."""
    from data.store import Episode, EpisodeStore

    store = EpisodeStore(root / encoder, spec, fps=10, encoder=encoder, commit_interval_s=0.0)
    todo = [Episode("bench", i, e, ["bench task"] * len(e["reward"]),
                    np.arange(i * 1000, i * 1000 + len(e["reward"]), dtype=np.int64))
            for i, e in enumerate(eps)]
    durable: list[float] = []
    store.on_durable = lambda done, dropped: durable.extend(time.perf_counter() for _ in done)
    store.start()
    for ep in todo[:warmup]:  # encoder start-up (the pool's processes), not timed
        store.submit(ep)
    store.flush(600)
    burst = todo[warmup:]
    c0, t0 = time.thread_time(), time.perf_counter()
    for ep in burst:
        store.submit(ep)
    submit_s = time.perf_counter() - t0
    assert store.flush(1200), "writer did not drain"
    dt = time.perf_counter() - t0
    commits = store.counters["commits"]
    store.close()
    videos = sum(p.stat().st_size for p in (root / encoder / "videos").rglob("*.mp4"))
    frames = sum(len(e) for e in burst)
    return {"episodes_per_s": len(burst) / dt, "frames_per_s": frames / dt,
            "drain_s": dt, "submit_ms_per_episode": 1000 * submit_s / len(burst),
            "bytes_per_episode": videos / len(todo), "commits": commits - 1,
            "episodes": len(burst), "vcodec": store.vcodec,
            "submit_thread_cpu_s": time.thread_time() - c0}


def writer_section(args, spec) -> dict:
    eps = make_episodes(args.writer_episodes + 2, args.writer_len, 1, args.noise)
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-writer-"))
    try:
        old = bench_writer(eps, spec, root, "lerobot")
        new = bench_writer(eps, spec, root, "pool")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"writer_ratio": new["episodes_per_s"] / old["episodes_per_s"],
            "writer": {"lerobot": old, "pool": new, "episode_len": args.writer_len,
                       "cameras": f"{len(CAMS)}x{H}x{W}", "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()[0]}}


# ---- lerobot -------------------------------------------------------------------------------------


def lerobot_transitions(eps):
    """lerobot's input format: per transition, state / next_state dicts of [1, ...] tensors,
    images float32 [1, 3, H, W] in [0, 1]."""
    out = []
    for e in eps:
        m = len(e["reward"])
        obs = [{"observation.state": torch.from_numpy(e["observation.state"][t][None]),
                **{f"observation.images.{c}": torch.from_numpy(
                    e[f"observation.images.{c}"][t].transpose(2, 0, 1)[None].astype(np.float32) / 255.0)
                   for c in CAMS}} for t in range(m)]
        for t in range(m - 1):
            out.append(dict(state=obs[t], action=torch.from_numpy(e["action"][t][None]),
                            reward=float(e["reward"][t]), next_state=obs[t + 1],
                            done=bool(e["terminated"][t]), truncated=bool(e["truncated"][t])))
    return out


def lerobot_buffer(n: int, drq: bool):
    from lerobot.rl.buffer import ReplayBuffer as LeRobotReplayBuffer

    keys = ["observation.state"] + [f"observation.images.{c}" for c in CAMS]
    # optimize_memory=True as lerobot.rl.learner.initialize_replay_buffer builds it: next_state
    # is read back from the following row instead of stored apart
    return LeRobotReplayBuffer(n, device="cpu", storage_device="cpu", state_keys=keys, use_drq=drq,
                               image_augmentation_function=None if drq else (lambda x: x),
                               optimize_memory=True)


def lerobot_nbytes(rb) -> int:
    tensors = [*rb.states.values(), rb.actions, rb.rewards, rb.dones, rb.truncateds, rb.episode_ends,
               *rb.complementary_info.values()]
    if rb.next_states is not rb.states:
        tensors += list(rb.next_states.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_lerobot(eps, args) -> dict:
    trans = lerobot_transitions(eps)
    rb = lerobot_buffer(len(trans), args.drq)
    t = time.perf_counter()
    for tr in trans:
        rb.add(**tr)
    add_rate = len(trans) / (time.perf_counter() - t)
    res = {"memory_per_transition": lerobot_nbytes(rb) / len(rb), "add_per_s": add_rate,
           "sample256_per_s": rate(lambda: rb.sample(256), args.sample_iters)}
    return res, rb


def bench_lerobot_write(rb, root: Path) -> dict:
    n_eps = int(rb.truncateds[: rb.size].sum() + rb.dones[: rb.size].sum())
    frames = rb.size
    t = time.perf_counter()
    rb.to_lerobot_dataset("bench/lerobot", fps=10, root=root / "lerobot")
    dt = time.perf_counter() - t
    return {"write_episodes_per_s": n_eps / dt, "write_frames_per_s": frames / dt}


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=20, help="episodes in the buffers")
    p.add_argument("--episode-len", type=int, default=50)
    p.add_argument("--write-episodes", type=int, default=4, help="episodes written to disk")
    p.add_argument("--sample-iters", type=int, default=20)
    p.add_argument("--add-batch", type=int, default=32, help="records per Tandem add (wire batch)")
    p.add_argument("--codec", default="auto", choices=["auto", "raw", "lz4", "zlib"],
                   help="Tandem image storage (auto, the learner's default: lz4 if installed)")
    p.add_argument("--noise", type=float, default=2.0, help="camera noise (std, grey levels)")
    p.add_argument("--images", action="store_true", help="write PNG images instead of video")
    p.add_argument("--drq", action="store_true", help="lerobot samples with its DrQ augmentation")
    p.add_argument("--no-write", action="store_true", help="skip the disk write benchmark")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--writer-episodes", type=int, default=30,
                   help="episodes in the writer burst (0: skip the writer bench)")
    p.add_argument("--writer-len", type=int, default=20, help="steps per writer-bench episode")
    p.add_argument("--writer-only", action="store_true", help="run only the writer bench")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = bench_spec(S, A, CAMS, (H, W))
    if args.writer_only:
        result = writer_section(args, spec)
        if args.json:
            emit_json(result)
        else:
            print_writer(result)
        return result
    eps = make_episodes(args.episodes, args.episode_len, 0, args.noise)
    tandem = bench_tandem(eps, spec, args)
    lerobot, lrb = bench_lerobot(eps, args)
    if not args.no_write:
        root = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
        try:
            w_eps = eps[: max(2, args.write_episodes + 1)]
            tandem.update(bench_tandem_write(w_eps, spec, args, root))
            small = lerobot_buffer(sum(len(e["reward"]) - 1 for e in w_eps[1:]), False)
            for tr in lerobot_transitions(w_eps[1:]):
                small.add(**tr)
            try:
                lerobot.update(bench_lerobot_write(small, root))
            except Exception as exc:  # report, do not hide
                lerobot["write_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(root, ignore_errors=True)
    del lrb
    ratios = {
        "memory_ratio": tandem["memory_per_transition"] / lerobot["memory_per_transition"],
        "sample_ratio": tandem["sample256_per_s"] / lerobot["sample256_per_s"],
        "add_ratio": tandem["add_per_s"] / lerobot["add_per_s"],
    }
    if "write_episodes_per_s" in tandem and "write_episodes_per_s" in lerobot:
        ratios["write_ratio"] = tandem["write_episodes_per_s"] / lerobot["write_episodes_per_s"]
    if not args.no_write and args.writer_episodes > 0:
        ratios.update(writer_section(args, spec))
    result = {**ratios, "tandem": tandem, "lerobot": lerobot,
              "setup": {"episodes": args.episodes, "episode_len": args.episode_len,
                        "transitions": args.episodes * args.episode_len, "cameras": f"2x{H}x{W}",
                        "state": S, "action": A, "codec": args.codec, "drq": args.drq,
                        "video": not args.images, "torch_threads": torch.get_num_threads(),
                        "cpus": os.cpu_count()}}
    if args.json:
        emit_json(result)
        return result
    print(f"same {args.episodes * args.episode_len} transitions: 2 cameras {H}x{W} + state {S}, "
          f"episodes of {args.episode_len} (Tandem images: {args.codec})")
    rows = [("memory per transition (bytes)", "memory_per_transition", "{:,.0f}"),
            ("add (transitions/s)", "add_per_s", "{:,.0f}"),
            ("sample(256) (batches/s)", "sample256_per_s", "{:,.2f}"),
            ("episode write (episodes/s)", "write_episodes_per_s", "{:,.2f}"),
            ("episode write (frames/s)", "write_frames_per_s", "{:,.1f}")]
    print(f"{'':32s} {'Tandem':>14s} {'lerobot':>14s} {'Tandem/lerobot':>15s}")
    for name, key, fmt in rows:
        a, b = tandem.get(key), lerobot.get(key)
        if a is None or b is None:
            print(f"{name:32s} {fmt.format(a) if a is not None else 'n/a':>14s} "
                  f"{fmt.format(b) if b is not None else lerobot.get('write_error', 'n/a'):>14s}")
            continue
        print(f"{name:32s} {fmt.format(a):>14s} {fmt.format(b):>14s} {a / b:>15.3f}")
    print(f"memory_ratio {ratios['memory_ratio']:.4f} (target <= 0.125), "
          f"sample_ratio {ratios['sample_ratio']:.2f} (target >= 1)")
    if "writer" in result:
        print_writer(result)
    return result


def print_writer(result: dict) -> None:
    w = result["writer"]
    print(f"episode writer, burst of {w['pool']['episodes']} episodes of {w['episode_len']} steps, "
          f"{w['cameras']}, until durable:")
    for name in ("lerobot", "pool"):
        r = w[name]
        print(f"  {name:8s} ({r['vcodec']:9s}) {r['episodes_per_s']:7.2f} episodes/s  "
              f"{r['bytes_per_episode'] / 1024:7.1f} KiB video/episode  {r['commits']} commits")
    print(f"writer_ratio {result['writer_ratio']:.2f} (target >= 5)")


if __name__ == "__main__":
    main()
