"""How ``inference.batch_due_ms`` batches closed-loop simulated actors: a discrete-event model.

N actors each think (step their simulator) for a time drawn around their own mean, with a reset
every episode, and then ask; one server batches their requests the way
``learner.inference.InferenceServer._gather`` does (the first request, every request already
queued, then lingering up to ``batch_window_ms``, or up to ``batch_due_ms`` for the actors
:class:`learner.arrivals.Arrivals` forecasts as due), and a forward of b rows takes
``forward(b)``. The model uses the real ``Arrivals``; the rest is a model of the server, not
the server. It reports the mean served batch, forwards per second, the share of the GPU the
forwards take (what training can no longer use under the serving window) and the actors'
chunks per second, for each ``--due-ms``.

    python -m tools.bench.due_model --due-ms 0,100,300 --think-ms 198,219 --sd-ms 30

Closed-loop LIBERO actors drift out of phase: each one's think time varies from chunk to chunk
and resets take longer. Two groups half a cycle apart then stay apart unless a lone actor may
wait about a whole cycle (think time plus the forward) for the others: below that ``batch_due_ms``
raises the batch little.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import Counter


def linear_forward(b1_ms: float, b8_ms: float):
    """A forward's seconds at b rows, on the line through its batch-1 and batch-8 times."""
    slope = (b8_ms - b1_ms) / 7.0
    return lambda b: (b1_ms + slope * (b - 1)) / 1000.0


def simulate(due_ms: float, *, actors: int = 8, seconds: float = 120.0, seed: int = 0, window_ms: float = 2.0,
             forward=linear_forward(20.0, 57.0), think_ms: tuple[float, float] = (198.0, 219.0),
             sd_ms: float = 30.0, chunks_per_episode: int = 44, reset_s: float = 0.8) -> dict:
    """One run of the model: ``actors`` closed-loop actors, each with a mean think time drawn
    uniformly in ``think_ms`` and a normal spread of ``sd_ms`` per chunk, a reset of ``reset_s``
    every ``chunks_per_episode`` chunks (each actor starts at a random point of its episode)."""
    from learner.arrivals import Arrivals

    rng = random.Random(seed)
    arr = Arrivals() if due_ms > 0 else None
    mean = [rng.uniform(*think_ms) / 1000.0 for _ in range(actors)]
    count = [rng.randrange(chunks_per_episode) for _ in range(actors)]
    pending: list[tuple[float, int]] = []  # (arrival time, actor)
    for i in range(actors):
        heapq.heappush(pending, (rng.uniform(0.0, 0.3), i))
    t, busy, batches = 0.0, 0.0, []
    while t < seconds:
        t_first, first = heapq.heappop(pending)
        t = max(t, t_first)
        reqs = [first]
        if arr is not None:
            arr.arrived(bytes([first]), t_first)

        def take(now: float) -> None:
            while pending and pending[0][0] <= now and len(reqs) < actors:
                t_j, j = heapq.heappop(pending)
                reqs.append(j)
                if arr is not None:
                    arr.arrived(bytes([j]), t_j)
        take(t)
        deadline, due_limit = t + window_ms / 1000.0, t + due_ms / 1000.0
        while len(reqs) < actors:
            until = deadline
            if arr is not None:
                due = arr.expected(t, due_limit)
                if due is not None and due > until:
                    until = due
            if until <= t:
                break
            if pending and pending[0][0] <= until:
                t = pending[0][0]
                take(t)
            else:
                t = until
                break
        f = forward(len(reqs))
        t += f
        busy += f
        batches.append(len(reqs))
        for j in reqs:
            if arr is not None:
                arr.replied(bytes([j]), t)
            count[j] += 1
            think = max(0.02, rng.gauss(mean[j], sd_ms / 1000.0))
            if count[j] % chunks_per_episode == 0:
                think += reset_s
            heapq.heappush(pending, (t + think, j))
    return {"due_ms": due_ms, "mean_batch": sum(batches) / len(batches), "forwards_per_s": len(batches) / t,
            "gpu_share": busy / t, "chunks_per_s": sum(batches) / t,
            "batch_sizes": {str(k): v for k, v in sorted(Counter(batches).items())}}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--due-ms", default="0,100,200,300,400")
    ap.add_argument("--actors", type=int, default=8)
    ap.add_argument("--think-ms", default="198,219", help="range of the actors' mean think times (ms)")
    ap.add_argument("--sd-ms", type=float, default=30.0, help="spread of one actor's think time, chunk to chunk")
    ap.add_argument("--reset-s", type=float, default=0.8)
    ap.add_argument("--chunks-per-episode", type=int, default=44)
    ap.add_argument("--forward-ms", default="20,57", help="a forward's time at batch 1 and batch 8 (ms)")
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lo, hi = (float(x) for x in args.think_ms.split(","))
    b1, b8 = (float(x) for x in args.forward_ms.split(","))
    rows = []
    for due in (float(x) for x in args.due_ms.split(",") if x):
        runs = [simulate(due, actors=args.actors, seconds=args.seconds, seed=s, window_ms=args.window_ms,
                         forward=linear_forward(b1, b8), think_ms=(lo, hi), sd_ms=args.sd_ms,
                         chunks_per_episode=args.chunks_per_episode, reset_s=args.reset_s)
                for s in range(args.seeds)]
        row = {k: sum(r[k] for r in runs) / len(runs) for k in ("mean_batch", "forwards_per_s", "gpu_share", "chunks_per_s")}
        row["due_ms"] = due
        rows.append(row)
        print(f"batch_due_ms {due:5.0f}: mean batch {row['mean_batch']:.2f}, {row['forwards_per_s']:.1f} forwards/s, "
              f"GPU share {row['gpu_share']:.2f}, {row['chunks_per_s']:.1f} chunks/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
