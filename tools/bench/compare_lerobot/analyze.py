"""The comparison's five rows, computed from what each system shows from outside.

Inputs are timestamped facts, never the systems' own summaries:

- LeRobot: ``CMPEVENT`` lines of :mod:`tools.bench.compare_lerobot.lerobot_entry` (``step`` with
  reward/done at the actor, ``load`` when the actor loads new weights, ``update`` and ``push``
  at the learner, ``ingest`` with the learner's replay size).
- Tandem: ``status.json`` samples (learner: ``updates``, ``version``, ingested ``env_steps``,
  windowed ``success``/``episodes``; per actor: the newest policy version in its records) and
  the actor's log lines (``steps N | ...``), each stamped with the time it was read.

Rows (each over the steady window: from the first env step to the end of the run):

- ``env_steps_per_s``: env steps the actor ran per second;
- ``updates_per_s``: learner optimisation steps per second (one = ``utd_ratio`` critic updates
  + one actor update, in both systems), from the first update to the end;
- ``transitions_per_s``: transitions in the learner's replay per second;
- ``update_to_act_s``: for every learner update, seconds until the actor first acts with
  weights that include it (median over updates). LeRobot: the update's time to the actor's
  first ``load`` of a push made at or after it (pushes every 4 s; the actor loads at episode
  ends); Tandem: the first status sample showing the update (its ``updates`` count) to the
  actor's first log line (every second) showing a version that includes it (version k holds
  updates up to ``k * publish_every``) or a newer one; resolution about one second;
- ``time_to_success_s``: seconds from the first env step until the success rate over the last
  ``window`` finished episodes reaches ``threshold`` (None: not reached);
- ``final_success``: the success rate over the last ``window`` finished episodes at the end
  (Tandem: its learner's windowed ``success``, ``logging.stats_window=window``).

Besides the rows, ``success_curve``: [seconds from the first env step, success rate over the
last ``window`` finished episodes (fewer at the start), episodes so far] at each episode end;
``updates_curve``: [seconds from the first env step, learner updates so far] (at most
``CURVE_POINTS`` points).
:func:`summarize` reduces repeated runs of one side to median, min and max per figure.
"""

from __future__ import annotations

import bisect
import json
import re
import math
from statistics import median
from typing import Iterable

EVENT = re.compile(r"CMPEVENT (\{.*\})")
TANDEM_ACTOR_STEPS = re.compile(r"steps (\d+) \| [\d.]+ steps/s \| episodes (\d+)")
TANDEM_ACTOR_VERSION = re.compile(r"\| version (-?\d+)")
CURVE_POINTS = 200


def _thin(points: list[tuple[float, int]], t0: float) -> list[list]:
    """(time, count) -> at most CURVE_POINTS [seconds from t0, count], the last one kept."""
    step = max(1, len(points) // CURVE_POINTS)
    keep = points[::step] + ([points[-1]] if points and (len(points) - 1) % step else [])
    return [[round(t - t0, 1), n] for t, n in keep]


def parse_events(lines: Iterable[str]) -> list[dict]:
    """The ``CMPEVENT`` json objects in ``lines`` (other lines and broken json skipped)."""
    out = []
    for line in lines:
        m = EVENT.search(line)
        if m:
            try:
                out.append(json.loads(m.group(1)))
            except json.JSONDecodeError:
                continue
    return out


def _rate(points: list[tuple[float, float]]) -> float | None:
    """(t, cumulative count) points -> count per second between the first and last point."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def windowed_success_time(outcomes: list[tuple[float, bool]], t0: float, *, threshold: float,
                          window: int) -> float | None:
    """Seconds after ``t0`` when the last ``window`` episodes' success rate first reaches
    ``threshold`` (``outcomes``: (end time, success) in order); None if never."""
    for i in range(window, len(outcomes) + 1):
        last = outcomes[i - window:i]
        if sum(ok for _, ok in last) / window >= threshold:
            return round(last[-1][0] - t0, 1)
    return None


def _latency(updates: list[float], publish: list[tuple[float, int]],
             acted: list[tuple[float, int]]) -> dict | None:
    """Seconds from each update (time) to the actor's first acting with a weight version that
    includes it: the first version published at or after the update, or any newer one.
    Updates the actor had not acted on by the end are left out (``censored`` counts them)."""
    lat, censored = [], 0
    pub_t = [t for t, _ in publish]
    # the first time the actor acted with a version >= v, per v (a running maximum)
    first_acted: dict[int, float] = {}
    best = -1
    for t, w in acted:
        for v in range(best + 1, w + 1):
            first_acted[v] = t
        best = max(best, w)
    for tu in updates:
        i = bisect.bisect_left(pub_t, tu)
        v = publish[i][1] if i < len(publish) else None
        ta = first_acted.get(v) if v is not None else None
        if ta is None:
            censored += 1
            continue
        lat.append(max(0.0, ta - tu))
    if not lat:
        return None
    return {"median": round(median(lat), 2), "mean": round(sum(lat) / len(lat), 2), "n": len(lat),
            "censored": censored}


def lerobot_rows(events: list[dict], t_end: float, *, threshold: float, window: int) -> dict:
    steps = [e for e in events if e["ev"] == "step"]
    if not steps:
        return {"error": "no env step"}
    t0 = steps[0]["t"]
    step_pts = [(e["t"], i + 1) for i, e in enumerate(steps)] + [(t_end, len(steps))]
    ups = [e["t"] for e in events if e["ev"] == "update"]
    up_pts = [(t, i + 1) for i, t in enumerate(ups)] + ([(t_end, len(ups))] if ups else [])
    ing = [(e["t"], e["n"]) for e in events if e["ev"] == "ingest"]
    # versions: the k-th push is version k (the first push, before any update, is version 0)
    pushes = [e for e in events if e["ev"] == "push"]
    publish = [(e["t"], k) for k, e in enumerate(pushes)]
    acted = []
    pub_t = [t for t, _ in publish]
    for e in events:
        if e["ev"] == "load":
            i = bisect.bisect_right(pub_t, e["t"])
            if i:
                acted.append((e["t"], publish[i - 1][1]))
    outcomes, ok = [], False
    for e in steps:
        # success: the env's own flag where the actor logged it (gym-hil's info["succeed"]),
        # else a sparse reward of 1
        ok = ok or (bool(e["ok"]) if "ok" in e else e.get("r", 0.0) >= 1.0)
        if e.get("done"):
            outcomes.append((e["t"], ok))
            ok = False
    trained_loads = [t for t, k in acted if pushes[k].get("step", 0) > 0]
    curve = []
    for i, (t, _) in enumerate(outcomes):
        last = outcomes[max(0, i + 1 - window):i + 1]
        curve.append([round(t - t0, 1), round(sum(ok for _, ok in last) / len(last), 3), i + 1])
    return {
        "env_steps": len(steps),
        "env_steps_per_s": _rate([(t0, 0)] + step_pts),
        "updates": len(ups),
        "updates_per_s": _rate([(ups[0], 0)] + up_pts) if ups else 0.0,
        "transitions": ing[-1][1] if ing else 0,
        "transitions_per_s": (ing[-1][1] / (t_end - t0)) if ing and t_end > t0 else 0.0,
        "update_to_act_s": _latency(ups, publish, acted),
        "episodes": len(outcomes),
        "successes": sum(ok for _, ok in outcomes),
        "time_to_success_s": windowed_success_time(outcomes, t0, threshold=threshold, window=window),
        "final_success": curve[-1][1] if curve else None,
        "first_trained_weights_acted_s": round(trained_loads[0] - t0, 1) if trained_loads else None,
        "steady_s": round(t_end - t0, 1),
        "success_curve": curve,
        "updates_curve": _thin([(t0, 0)] + up_pts, t0),
    }


def _update_times(counts: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(time, cumulative updates) samples -> (time first seen, update number) per update."""
    out, done = [], 0
    for t, n in counts:
        out += [(t, u) for u in range(done + 1, n + 1)]
        done = max(done, n)
    return out


def _tandem_latency(updates: list[tuple[float, int]], acted: list[tuple[float, int]],
                    publish_every: int) -> dict | None:
    """Seconds from each update to the actor's first log of a version holding it."""
    lat, censored = [], 0
    for tu, u in updates:
        need = math.ceil(u / publish_every)
        ta = next((t for t, w in acted if w >= need and t >= tu), None)
        if ta is None:
            censored += 1
            continue
        lat.append(ta - tu)
    if not lat:
        return None
    return {"median": round(median(lat), 2), "mean": round(sum(lat) / len(lat), 2), "n": len(lat),
            "censored": censored}


def tandem_rows(samples: list[dict], actor_lines: list[tuple[float, str]], t_end: float, *,
                threshold: float, window: int, publish_every: int = 1) -> dict:
    """``samples``: {"t", "status"} in time order; ``actor_lines``: (time read, line);
    ``publish_every``: the learner's updates per weight version."""
    steps = [(t, int(m.group(1)), int(m.group(2))) for t, line in actor_lines
             if (m := TANDEM_ACTOR_STEPS.search(line))]
    ingested = [(s["t"], s["status"].get("env_steps", 0)) for s in samples]
    t0 = next((t for t, n in ingested if n > 0), None)
    if t0 is None:
        return {"error": "no env step reached the learner"}
    win = [s for s in samples if s["t"] >= t0]
    ups = [(s["t"], s["status"].get("updates", 0)) for s in win]
    up_start = next(((t, n) for t, n in ups if n > 0), None)
    # acted: the version in the actor's own log lines (the learner writes status.json between
    # updates, so its per-actor versions are as old as one update); status as a fallback
    acted = [(t, int(m.group(1))) for t, line in actor_lines if (m := TANDEM_ACTOR_VERSION.search(line))]
    if not acted:
        for s in win:
            vs = [r["version"] for r in s["status"].get("actors_table", []) if r.get("version") is not None]
            if vs and max(vs) >= 0:
                acted.append((s["t"], max(vs)))
    success_t, curve, seen = None, [], 0
    for s in win:
        st = s["status"]
        if st.get("episodes", 0) > seen and st.get("success") is not None and st["success"] == st["success"]:
            seen = st["episodes"]
            curve.append([round(s["t"] - t0, 1), round(float(st["success"]), 3), seen])
    for s in win:
        st = s["status"]
        if (st.get("episodes", 0) >= window and st.get("success") is not None
                and st["success"] == st["success"] and st["success"] >= threshold):
            success_t = round(s["t"] - t0, 1)
            break
    last = win[-1]["status"] if win else {}
    first_trained = next((t for t, v in acted if v >= 1), None)
    return {
        "env_steps": steps[-1][1] if steps else last.get("env_steps"),
        "env_steps_per_s": _rate([(t, n) for t, n, _ in steps if t >= t0 - 10]) if len(steps) > 1
        else _rate([(t, n) for t, n in ingested if t >= t0]),
        "updates": last.get("updates", 0),
        "updates_per_s": _rate([up_start] + [p for p in ups if p[0] > up_start[0]]) if up_start else 0.0,
        "transitions": last.get("env_steps", 0),
        "transitions_per_s": _rate([(t, n) for t, n in ingested if t >= t0]),
        # an update is dated by the first status sample counting it
        "update_to_act_s": _tandem_latency(_update_times(ups), acted, publish_every),
        "episodes": last.get("episodes", 0),
        "success_window": last.get("success"),
        "final_success": last.get("success") if last.get("episodes", 0) else None,
        "time_to_success_s": success_t,
        "first_trained_weights_acted_s": round(first_trained - t0, 1) if first_trained else None,
        "steady_s": round(t_end - t0, 1),
        "success_curve": curve,
        "updates_curve": _thin([(t0, 0)] + [(t, n) for t, n in ups if t <= t_end], t0),
    }


ROWS = ("env_steps_per_s", "updates_per_s", "transitions_per_s", "update_to_act_s", "time_to_success_s",
        "final_success")
LOWER_IS_BETTER = ("update_to_act_s", "time_to_success_s")


def _num(v):
    return v["median"] if isinstance(v, dict) else v


def summarize(runs: list[dict]) -> dict:
    """Per row (and episodes, successes, first trained weights): median, min, max and the
    values over the runs that have it (runs with an error are left out; None: not reached)."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": len(runs), "errors": len(runs) - len(ok)}
    for row in (*ROWS, "episodes", "successes", "first_trained_weights_acted_s", "startup_s"):
        vals = [_num(r.get(row)) for r in ok]
        got = [v for v in vals if v is not None]
        out[row] = {"median": round(median(got), 3) if got else None,
                    "min": round(min(got), 3) if got else None, "max": round(max(got), 3) if got else None,
                    "values": [round(v, 3) if v is not None else None for v in vals]}
    return out


def ratios(tandem: dict, lerobot: dict) -> dict:
    """Tandem / LeRobot per row, oriented so that > 1 means Tandem is ahead (for the
    lower-is-better rows: LeRobot / Tandem). None where a side has no number."""
    out = {}
    for row in ROWS:
        a, b = _num(tandem.get(row)), _num(lerobot.get(row))
        if a is None or b is None or a <= 0 or b <= 0:
            out[row] = None
        else:
            out[row] = round((b / a) if row in LOWER_IS_BETTER else (a / b), 2)
    return out
