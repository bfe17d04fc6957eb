"""What operators see, tested as a person would: the live views in tmux (send-keys /
capture-pane), the run plot of a real run, the rerun stream saved by an actor, and the
evaluation report. Real learner and actor processes on loopback, point_reach."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_testutil import ROOT, free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
       "TANDEM_PYTHON": sys.executable, "RERUN_ANALYTICS": "0"}
PEER_TIMEOUT_S = 3.0


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


class Tmux:
    def __init__(self, socket: str):
        self.socket = socket

    def __call__(self, *args, check=True) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True,
                              check=check, env=ENV).stdout

    def pane(self, index: int) -> str:
        return self("capture-pane", "-p", "-t", f"tandem:0.{index}", check=False)

    def wait(self, index: int, cond, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.pane(index)
            if cond(text):
                return text
            time.sleep(0.5)
        raise AssertionError(f"pane {index}: timed out waiting for {what}:\n{text}")


def _row(text: str, actor: str) -> str:
    """The learner table's row of ``actor`` (the last one on screen)."""
    rows = [line for line in text.splitlines() if re.search(rf"│\s*{actor}\s*│", line)]
    return rows[-1] if rows else ""


@pytest.fixture(scope="module")
def tmux_run(tmp_path_factory):
    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed")
    run_dir = tmp_path_factory.mktemp("console") / "run"
    tmux = Tmux(f"tandem-test-{os.getpid()}")
    port = free_port()
    args = ["bash", str(ROOT / "launch" / "tmux.sh"), "--actors", "2", "env=point_reach",
            f"run_dir={run_dir}", f"transport.port={port}", f"transport.pub_port={free_port()}",
            "transport.heartbeat_s=0.5", f"learner:transport.peer_timeout_s={PEER_TIMEOUT_S}",
            "learner:logging.wandb=disabled", "learner:logging.every_s=1",
            "learner:algo.learning_starts=100", "learner:trainer.num_threads=1",
            "actor:spool.fsync=false"]
    subprocess.run(args, cwd=ROOT, check=True, timeout=30,
                   env={**ENV, "TANDEM_TMUX_SOCKET": tmux.socket, "TANDEM_TMUX_NO_ATTACH": "1",
                        "TANDEM_TMUX_WIDTH": "180", "TANDEM_TMUX_HEIGHT": "60"})
    try:
        yield tmux, run_dir
    finally:
        tmux("kill-server", check=False)
        time.sleep(1)
        for pid in _pids(f"run_dir={run_dir}"):  # only the processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_live_views_in_tmux_show_actors_and_a_killed_one_disconnects(tmux_run):
    tmux, run_dir = tmux_run
    both = tmux.wait(0, lambda t: "connected" in _row(t, "actor-0") and "connected" in _row(t, "actor-1")
                     and "steps/s" in t, 120, "a table with two connected actors")
    assert "disconnected" not in _row(both, "actor-0") + _row(both, "actor-1")
    assert "phase" in both and "buffer" in both and "dataset writer" in both
    # both actors make progress (steps/s column) and act through the learner (remote, act p50)
    text = tmux.wait(0, lambda t: all(re.search(r"remote\s*│\s*[1-9][\d.]*\s*│\s*[\d.]+ ms", _row(t, a))
                                      for a in ("actor-0", "actor-1")), 60, "steps/s and act latency")
    actor_pane = tmux.wait(1, lambda t: "POLICY in control" in t and "connected to learner" in t, 60,
                           "the actor panel")
    assert "hotkeys" in actor_pane and re.search(r"episode\s+\d+ · step \d+ · return", actor_pane)
    assert re.search(r"served \d+", actor_pane)

    victim = _pids(f"[-]m actor actor_id=actor-1 .*run_dir={run_dir}")
    assert len(victim) == 1, victim
    os.kill(victim[0], signal.SIGKILL)
    t0 = time.monotonic()
    text = tmux.wait(0, lambda t: "disconnected" in _row(t, "actor-1"), PEER_TIMEOUT_S + 4,
                     "actor-1 shown as disconnected")
    took = time.monotonic() - t0
    assert "disconnected" not in _row(text, "actor-0")
    assert took <= PEER_TIMEOUT_S + 4
    # status.json holds the same per-actor rows
    st = json.loads((run_dir / "status.json").read_text())
    rows = {r["actor"]: r for r in st["actors_table"]}
    assert set(rows) == {"actor-0", "actor-1"} and rows["actor-0"]["steps"] > 0


def test_plot_run_on_the_real_run(tmux_run, tmp_path):
    _, run_dir = tmux_run
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a few logging ticks with updates
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if len(lines) >= 3 and json.loads(lines[-1]).get("updates", 0) > 0:
            break
        time.sleep(1)
    rows = [json.loads(x) for x in lines]
    assert len(rows) >= 3
    steps = [r["env_steps"] for r in rows]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    assert all(r["wall_s"] >= 0 for r in rows) and any("critic_loss" in r for r in rows)
    # where the main thread's time went in each period: shares and seconds, never negative
    ticks = [r for r in rows if "train_busy" in r]
    assert ticks and all(0 <= r["train_busy"] <= 1.05 and r["publish_s"] >= 0 and r["checkpoint_s"] >= 0
                         for r in ticks)
    assert all(r["step_s"] > 0 for r in ticks if "step_s" in r) and any("step_s" in r for r in ticks)
    other = tmp_path / "other"  # overlay: a second run folder (the first half of this one)
    other.mkdir()
    (other / "metrics.jsonl").write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    out = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, "-m", "tools.plot_run", str(run_dir), str(other), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(out)
    from PIL import Image

    img = Image.open(out)
    assert img.size[0] > 500 and img.size[1] > 500
    assert len(set(img.convert("RGB").get_flattened_data())) > 50  # curves, not a blank canvas
    bad = subprocess.run([sys.executable, "-m", "tools.plot_run", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert bad.returncode != 0 and "no metrics.jsonl" in bad.stderr


def _rrd_read(rrd: Path) -> dict[str, list[tuple[int, float]]]:
    """entity path -> its chunks' rows: (episode_step, scalar value), or (step, nan) for
    non-scalars; read back by rerun's own CLI."""
    exe = Path(sys.executable).with_name("rerun")
    out = subprocess.run([str(exe), "rrd", "print", "-vvv", str(rrd)], capture_output=True, text=True,
                         timeout=120, env=ENV, check=True).stdout
    rows: dict[str, list] = {}
    entity = None
    for line in out.splitlines():
        m = re.match(r"Chunk\(\w+\) with \d+ rows .* - (/\S+) -", line)
        if m:
            entity = m.group(1)
            rows.setdefault(entity, [])
        elif entity and line.startswith("│ │ row_"):
            m = re.match(r"│ │ row_\w+\s+┆ (\d+)\s+┆ [\dT:.\-]+\s+┆ \d+\s+┆ \[([-\d.e]+)\]", line)
            rows[entity].append((int(m.group(1)), float(m.group(2))) if m else (-1, float("nan")))
    return rows


def test_eval_report_and_rerun_save(tmp_path):
    run_dir = tmp_path / "run"
    port, pub = free_port(), free_port()
    common = ["env=point_reach", f"run_dir={run_dir}", f"transport.port={port}",
              f"transport.pub_port={pub}", "transport.heartbeat_s=0.5"]
    learner = subprocess.Popen([sys.executable, "-m", "learner", *common, "mode=eval", "eval.episodes=8",
                                "logging.wandb=disabled", "logging.every_s=1"], cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rrd = tmp_path / "live.rrd"
    actor = subprocess.run([sys.executable, "-m", "actor", *common, "actor_id=a0", "spool.fsync=false",
                            "rerun=save", f"rerun_path={rrd}", "intervention.device=scripted",
                            "intervention.takeover_steps=[0,1]", "intervention.action=[0.5,0.5]"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    out, _ = learner.communicate(timeout=120)
    assert learner.returncode == 0, out[-3000:]
    assert actor.returncode == 0, actor.stdout[-3000:]
    report = json.loads((run_dir / "eval_report.json").read_text())
    md = (run_dir / "eval_report.md").read_text()
    assert report["episodes"] >= 8
    for task, r in report["per_task"].items():
        assert f"| {task} | {r['success']:.2f} | {r['return']:.2f} | {int(r['episodes'])} |" in md
    assert sum(int(r["episodes"]) for r in report["per_task"].values()) == report["episodes"]
    from PIL import Image

    assert Image.open(run_dir / "eval_report.png").size[0] > 200
    videos = sorted((run_dir / "eval_videos").glob("*.mp4"))
    assert videos and all(v.stat().st_size > 0 for v in videos)
    import av

    with av.open(str(videos[0])) as c:
        frames = sum(1 for _ in c.decode(video=0))
    assert 1 <= frames <= 30  # point_reach episodes are at most 30 steps

    # the rerun stream: one row per env step on every entity, the intervention flag on the
    # scripted takeover steps (0 and 1 of every episode) and only there
    read = _rrd_read(rrd)
    interv = read["/flags/intervened"]
    assert len(interv) > 20
    for entity in ("/reward", "/policy_version", "/action/0", "/action/1", "/cameras/image"):
        assert len(read[entity]) == len(interv), entity
    assert all((v == 1.0) == (step in (0, 1)) for step, v in interv), interv[:40]
