"""What the person at the GPU box sees: a live rich view of the learner (when stdout is a
terminal), fed from the same numbers as ``status.json`` (:func:`view_status`).

The view: one row per actor (connected, mode, steps/s, act latency p50, unacknowledged
records, policy version lag, interventions and success over its last N episodes), then
updates/s, buffer fill, episodes waiting for the dataset writer, store lag, GPU memory and
utilisation (with a GPU) and the algorithm's phase. Log lines keep printing above it. When
stdout is not a terminal (pipes, ``run_local.sh``, tests) nothing changes: the plain status
line every ``logging.every_s`` as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from data.stdio import TerminalTakeover

log = logging.getLogger("tandem.learner")


class RateMeter:
    """Rate of a growing counter over the last ``span_s`` seconds."""

    def __init__(self, span_s: float = 10.0):
        self.span_s = span_s
        self._samples: deque = deque(maxlen=256)

    def rate(self, value: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._samples.append((now, value))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.span_s:
            self._samples.popleft()
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class Stages:
    """A tqdm bar over the named stages of one long step (on stderr, only on a terminal):
    ``with Stages("checkpoint x", ["reading", "restoring"]) as stage: ...; stage(); ...``."""

    def __init__(self, label: str, names: list[str]):
        self.label, self.names, self.bar, self._i = label, names, None, 0

    def __enter__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=len(self.names), desc=self.label, unit="stage", disable=None, leave=False)
        self.bar.set_postfix_str(self.names[0])
        return self

    def __call__(self) -> None:
        self._i += 1
        self.bar.update(1)
        if self._i < len(self.names):
            self.bar.set_postfix_str(self.names[self._i])

    def __exit__(self, *exc) -> None:
        self.bar.update(len(self.names) - self._i)
        self.bar.close()


def gpu_status(device) -> dict[str, float] | None:
    """GPU memory (GiB, allocated / total) and utilisation (%), or None without a GPU."""
    try:
        import torch

        if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
            return None
        idx = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
        out = {"mem_gib": torch.cuda.memory_allocated(idx) / 2**30,
               "mem_total_gib": torch.cuda.get_device_properties(idx).total_memory / 2**30}
        try:
            out["util_pct"] = float(torch.cuda.utilization(idx))
        except Exception:  # no pynvml / NVML
            pass
        return out
    except Exception:  # pragma: no cover - a broken driver must not stop the learner
        return None


def phase_of(learner, updates_per_s: float) -> str:
    """collecting, training or evaluating (an algorithm's own ``phase`` wins when it has one)."""
    if learner.cfg.mode == "eval":
        return "evaluating"
    own = getattr(learner.algo, "phase", None)
    if isinstance(own, str) and own:
        return {"collect": "collecting", "train": "training", "eval": "evaluating",
                "pretrain": "training (pretrain)"}.get(own, own)
    return "training" if updates_per_s > 0 else "collecting"


def view_status(learner, base: dict[str, Any], rates: RateMeter) -> dict[str, Any]:
    """The per-actor rows and system numbers the view and ``status.json`` share."""
    service, ingest = learner.service, learner.ingest
    now = time.monotonic()
    peers = {p.actor_id: now - p.last_seen for p in list(service.peers.values())}
    received, acked = dict(ingest.received), dict(ingest.acked)
    rows = learner.actor_stats.rows(peers=peers, peer_timeout_s=float(service.peer_timeout_s),
                                    version=int(learner.weights.version), received=received,
                                    acked=acked)
    ups = rates.rate(float(base.get("updates", 0)), now)
    store = learner.data.status()
    lags = [r["version_lag"] for r in rows if r["connected"] and r["version_lag"] is not None]
    capacity = int(learner.cfg.buffer.capacity)
    return {
        "actors_table": rows,
        "updates_per_s": ups,
        "buffer_capacity": capacity,
        "buffer_fill": min(1.0, float(base.get("buffer", 0)) / capacity) if capacity else 0.0,
        "dataset_pending": int(store.get("dataset_pending", 0) or 0),
        "store_lag_records": sum(max(0, received.get(a, -1) - acked.get(a, -1)) for a in received),
        "version_lag": max(lags) if lags else 0,
        "interventions": sum(r["interventions"] for r in rows),
        "gpu": gpu_status(learner.device),
        "phase": phase_of(learner, ups),
        "mode": learner.cfg.mode,
    }


def _fmt(v, spec: str = "", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return none
    return format(v, spec)


def render(status: dict[str, Any], *, title: str = "Tandem learner"):
    """The rich renderable of a :func:`view_status` (merged with the base status) dict."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{title} · {status.get('mode', '')} · policy version "
                        f"{status.get('version', '?')} · {status.get('updates', 0)} updates",
                  expand=False, title_justify="left")
    for col, just in (("actor", "left"), ("link", "left"), ("mode", "left"), ("steps/s", "right"),
                      ("act p50", "right"), ("unacked", "right"), ("lag", "right"),
                      ("interv.", "right"), ("success", "right"), ("episodes", "right")):
        table.add_column(col, justify=just)
    for r in status.get("actors_table", []):
        link = (Text("connected", style="green") if r["connected"]
                else Text("disconnected", style="bold red"))
        table.add_row(
            r["actor"], link, r["mode"], _fmt(r["steps_per_s"], ".1f"),
            _fmt(r["act_p50_ms"], ".1f") + (" ms" if r["act_p50_ms"] is not None else ""),
            str(r["unacked"]), _fmt(r["version_lag"]),
            f"{r['interventions']}/{r['window']}", _fmt(r["success"], ".2f"), str(r["episodes"]))
    if not status.get("actors_table"):
        table.add_row("(no actor yet)", "", "", "", "", "", "", "", "", "")
    gpu = status.get("gpu")
    gpu_txt = "no GPU" if not gpu else (
        f"GPU {gpu['mem_gib']:.1f}/{gpu['mem_total_gib']:.0f} GiB"
        + (f", {gpu['util_pct']:.0f}% util" if "util_pct" in gpu else ""))
    lines = [
        f"phase [bold]{status.get('phase', '?')}[/] · updates/s {status.get('updates_per_s', 0.0):.1f}"
        f" · env steps {status.get('env_steps', 0)} · episodes {status.get('episodes', 0)}"
        f" · return {_fmt(status.get('return'), '.2f')} · success {_fmt(status.get('success'), '.2f')}",
        f"buffer {status.get('buffer', 0)}/{status.get('buffer_capacity', 0)}"
        f" ({100 * status.get('buffer_fill', 0.0):.0f}%) · dataset writer: "
        f"{status.get('dataset_pending', 0)} episodes waiting · store lag "
        f"{status.get('store_lag_records', 0)} records · {gpu_txt}",
    ]
    parts: list = [table, *(Text.from_markup(x) for x in lines)]
    if status.get("eval_target"):
        from rich.progress_bar import ProgressBar

        done, total = int(status.get("episodes", 0)), int(status["eval_target"])
        parts.append(Group(Text(f"evaluation sweep: {min(done, total)}/{total} episodes, success so "
                                f"far {_fmt(status.get('success'), '.2f')}"),
                           ProgressBar(total=total, completed=min(done, total), width=40)))
    return Group(*parts)


class LiveView(TerminalTakeover):
    """The learner's live view (:func:`render`): a rich ``Live`` while stdout is a terminal;
    ``stray_output``: the file that native libraries' own writes to fds 1 and 2 go to meanwhile
    (:class:`data.stdio.TerminalTakeover`)."""

    def make_live(self, tty):
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        console = Console()
        if tty is not None:  # fd 1 goes to the stray output file: draw on the terminal's copy
            console = Console(file=tty, force_terminal=True, width=console.width, height=console.height)
        return Live(console=console, get_renderable=lambda: self.render(Text), redirect_stdout=True,
                    redirect_stderr=True, refresh_per_second=self.refresh_per_second)
