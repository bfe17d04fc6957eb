"""What the person at the robot sees: a live rich panel of the actor (when stdout is a
terminal; plain status lines otherwise, as before).

It shows who is in control (the policy or the human; or that the env is held because the
policy gives no action, and why) with the intervention device's hotkeys, the episode's step and return, the learner link (connected, reconnecting, silent
for how long, unacknowledged records), the policy version being served, and the outcome of
the recent episodes. The numbers are the ones the plain status line prints
(:class:`actor.loop.ActorLoop` and :class:`actor.client.LearnerClient` attributes).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from data.stdio import TerminalTakeover

HOTKEYS = {
    "keyboard": "[b]i[/] take over / hand back · w/s a/d r/f j/l u/o k/m move · [b]space[/] gripper · "
                "[b]y[/] success · [b]n[/] failure · [b]x[/] reset · [b]q[/] quit",
    "gamepad": "hold [b]RB[/] to take over · sticks move · [b]A[/]/[b]B[/] gripper · [b]Y[/] success · "
               "[b]X[/] failure · [b]Back[/] reset",
    "spacemouse": "move the cap to take over · left button gripper · right button success",
    "scripted": "scripted takeover (tests): no keys",
    "expert": "a scripted expert takes over when the policy drifts: no keys",
}
NO_DEVICE = "no intervention device (intervention.device=keyboard | gamepad | spacemouse)"


def actor_status(loop, client, *, device: str | None) -> dict[str, Any]:
    """The numbers of the actor's view, from the loop and the client (any thread may read)."""
    now = time.monotonic()
    last_rx = getattr(client, "_last_rx", 0.0) or 0.0
    return {
        "actor_id": loop.actor_id,
        "in_control": loop.in_control,
        "holding": getattr(loop, "holding", None),
        "act_failures": int(getattr(loop, "act_failures", 0)),
        "outages": int(getattr(loop, "outages", 0)),
        "device": device or "none",
        "episode": loop.episode,
        "episode_step": loop.episode_step,
        "episode_return": loop.episode_return,
        "steps": loop.steps,
        "episodes": loop.episodes,
        "success": float(np.mean(loop.successes)) if loop.successes else None,
        "return": float(np.mean(loop.returns)) if loop.returns else None,
        "interventions": loop.interventions,
        "connected": bool(client.connected),
        "reconnects": int(getattr(client, "reconnects", 0)),
        "silent_s": (now - last_rx) if last_rx else None,
        "learner_id": getattr(client, "learner_id", None),
        "learner_mode": getattr(client, "mode", "?"),
        "served_version": int(client.policy_version),
        "acting_version": int(loop.version),
        "unacked": len(client.spool),
        "dead_letters": int(getattr(client.spool, "dead_letters", 0)),
        "last_dead_letter": getattr(client.spool, "last_dead", None),
        "act_ms": float(getattr(client, "last_act_ms", 0.0)),
    }


def render(st: dict[str, Any]):
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    human = st["in_control"] == "human"
    if st.get("holding"):
        who = Text.from_markup("[bold black on yellow] HOLDING: no action from the policy [/] ")
        who.append(f"{st['holding'][:200]} (retrying; {st['act_failures']} failed requests, "
                   f"{st['outages']} outages)")
    else:
        who = Text.from_markup("[bold white on red] HUMAN in control [/]" if human
                               else "[bold black on green] POLICY in control [/]")
    keys = Text.from_markup("hotkeys: " + HOTKEYS.get(st["device"], NO_DEVICE))
    if st["connected"]:
        link = f"[green]connected[/] to learner {st['learner_id'] or '?'} ({st['learner_mode']})"
    else:
        link = "[bold red]not connected[/]: retrying" if st["reconnects"] or st["learner_id"] else \
            "[yellow]connecting[/]"
    if st["silent_s"] is not None:
        link += f" · last heard {st['silent_s']:.1f} s ago"
    link += f" · reconnects {st['reconnects']} · unacked {st['unacked']}"
    if st.get("dead_letters"):
        last = st.get("last_dead_letter") or {}
        link += (f" · [bold red]dead letters {st['dead_letters']}[/] (last: {last.get('code', '?')}, "
                 f"seq {last.get('first_seq', '?')}..{last.get('last_seq', '?')})")
    t = Table.grid(padding=(0, 2))
    t.add_column(style="dim")
    t.add_column()
    t.add_row("episode", f"{st['episode']} · step {st['episode_step']} · return {st['episode_return']:.2f}")
    t.add_row("learner link", Text.from_markup(link))
    t.add_row("policy version", f"served {st['served_version']} · acting with {st['acting_version']}"
              + (f" · act {st['act_ms']:.1f} ms" if st["act_ms"] else ""))
    succ = "-" if st["success"] is None else f"{st['success']:.2f}"
    ret = "-" if st["return"] is None else f"{st['return']:.2f}"
    t.add_row("recent episodes", f"{st['episodes']} done · success {succ} · return {ret} · "
              f"{st['interventions']} human steps · {st['steps']} steps")
    return Panel(Group(who, keys, t), title=f"Tandem actor {st['actor_id']}", title_align="left",
                 border_style="red" if human else "green")


class LiveView(TerminalTakeover):
    """The actor's live panel (:func:`render` of :func:`actor_status`): a rich ``Live`` while
    stdout is a terminal; a thin install without rich keeps the plain status lines."""

    def __init__(self, get_renderable, *, enabled: bool = True, refresh_per_second: float = 2.0):
        super().__init__(get_renderable, enabled=enabled, refresh_per_second=refresh_per_second)

    def make_live(self, tty):
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        return Live(console=Console(), get_renderable=lambda: self.render(Text), redirect_stdout=True,
                    redirect_stderr=True, refresh_per_second=self.refresh_per_second)
