"""Show one episode of a LeRobot dataset in rerun, on one timeline.

    python tools/view_episode.py runs/tandem/dataset --episode 3            # .rrd + viewer
    python tools/view_episode.py runs/tandem/dataset --episode -1 --save last.rrd --no-viewer

Logs, per frame of the episode on the ``frame`` timeline: every camera image, every action
dimension, the reward, the intervention, termination, truncation and chunk-start flags (as
0/1 plots), the chunk index, every scalar policy extra (``extra.log_prob`` ... as
``extras/<name>``), plus the task as a text entry. It always saves an ``.rrd`` file (default
``episode_<n>.rrd`` next to the dataset; open it later with ``rerun file.rrd``) and also opens
the live viewer where a display exists (``--no-viewer`` to skip). Works on any LeRobot v3.0
dataset, Tandem's or not: missing columns are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.store import read_episode_table, read_episodes, read_info  # noqa: E402

PLOTS = {  # dataset column -> rerun entity path
    "next.reward": "reward", "reward": "reward",
    "intervened": "flags/intervened", "complementary_info.is_intervention": "flags/intervened",
    "next.terminated": "flags/terminated", "next.done": "flags/terminated",
    "next.truncated": "flags/truncated", "next.success": "flags/success",
    "policy_version": "policy_version", "chunk_start": "flags/chunk_start",
    "chunk_index": "chunk_index",
}


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"


def log_episode(root: Path, episode: int, rr) -> dict:
    """Log one episode into the current rerun recording; returns a small summary."""
    info = read_info(root)
    ep = next(read_episodes(root, episodes=[episode]), None)
    if ep is None:
        raise SystemExit(f"{root}: no episode {episode}")
    n = len(ep)
    frames = ep.columns["frame_index"].astype(np.int64)
    times = rr.TimeColumn("frame", sequence=frames)
    action = np.asarray(ep.columns.get("action", np.zeros((n, 0))), np.float64).reshape(n, -1)
    for d in range(action.shape[1]):
        rr.send_columns(f"action/{d}", indexes=[times], columns=rr.Scalars.columns(scalars=action[:, d]))
    logged = set()
    for col, path in PLOTS.items():
        if col in ep.columns and path not in logged:
            v = np.asarray(ep.columns[col], np.float64).reshape(n)
            rr.send_columns(path, indexes=[times], columns=rr.Scalars.columns(scalars=v))
            logged.add(path)
    for col, v in ep.columns.items():  # scalar policy extras (log_prob, value, ...)
        if col.startswith("extra.") and np.asarray(v).ndim == 1 and np.asarray(v).dtype.kind in "biuf":
            path = "extras/" + col[len("extra."):]
            rr.send_columns(path, indexes=[times],
                            columns=rr.Scalars.columns(scalars=np.asarray(v, np.float64)))
            logged.add(path)
    for i in range(n):
        rr.set_time("frame", sequence=int(frames[i]))
        for cam, imgs in ep.images.items():
            rr.log("cameras/" + cam.removeprefix("observation.images."), rr.Image(imgs[i]))
        if i == 0 or ep.tasks[i] != ep.tasks[i - 1]:
            rr.log("task", rr.TextLog(ep.tasks[i] or "(no task)"))
    return {"episode": episode, "frames": n, "cameras": sorted(ep.images), "fps": info["fps"],
            "plots": sorted(logged) + [f"action/{d}" for d in range(action.shape[1])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", type=Path, help="root folder of a local LeRobot v3.0 dataset")
    p.add_argument("--episode", type=int, default=0, help="episode index (negative: from the end)")
    p.add_argument("--save", type=Path, default=None, help="output .rrd (default: episode_<n>.rrd)")
    p.add_argument("--no-viewer", action="store_true", help="never open the live viewer")
    args = p.parse_args(argv)
    import rerun as rr

    table = read_episode_table(args.dataset)
    if not table:
        raise SystemExit(f"{args.dataset}: the dataset has no episodes")
    episodes = table["episode_index"].astype(int).tolist()
    episode = episodes[args.episode] if args.episode < 0 else args.episode
    out = args.save or args.dataset.parent / f"episode_{episode}.rrd"
    rr.init(f"tandem_episode_{episode}", spawn=False)
    sinks = [rr.FileSink(str(out))]
    viewer = has_display() and not args.no_viewer
    if viewer:
        try:
            rr.spawn(connect=False)
            sinks.append(rr.GrpcSink())
        except Exception as exc:  # no viewer binary, or it cannot start
            print(f"live viewer unavailable ({exc}); saving only", file=sys.stderr)
            viewer = False
    rr.set_sinks(*sinks)
    summary = log_episode(args.dataset, episode, rr)
    rr.disconnect()
    print(f"episode {episode}: {summary['frames']} frames, cameras {summary['cameras']}, plots "
          f"{summary['plots']} -> {out}" + (" (and the live viewer)" if viewer else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
