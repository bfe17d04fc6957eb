"""launch/libero_pair.sh's plumbing: two chains of one variant, told apart by TAG_A / TAG_B, each
with its own settings (SET_A / SET_B), write their results under their own names; two chains
that would share a folder are refused. Every stage's output exists beforehand, so each chain
skips its stages (the skip logic a rerun relies on) and no learner, actor or GPU is needed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _done_stages(r: Path, tags: list[str]) -> None:
    """Files that make every stage of launch/libero_chain.sh skip itself."""
    (r / "demos" / "meta").mkdir(parents=True)
    (r / "demos" / "meta" / "info.json").write_text("{}")
    (r / "sft").mkdir()
    (r / "sft" / "model.safetensors").write_bytes(b"")
    (r / "before").mkdir()
    (r / "before" / "eval_report.json").write_text(json.dumps({"overall": {"success": 0.4}}))
    (r / "res").mkdir()
    for tag in tags:
        (r / "res" / f"{tag}_metrics.jsonl").write_text("")
        (r / tag).mkdir()
        (r / tag / "eval_report.json").write_text(json.dumps({"tag": tag}))


def _pair(r: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "R": str(r), "TANDEM_PYTHON": "true", "GPU_LOG": "0", **env}
    return subprocess.run(["bash", str(ROOT / "launch" / "libero_pair.sh")], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


def test_two_chains_of_one_variant_write_apart_with_their_own_settings(tmp_path):
    r = tmp_path / "lr"
    _done_stages(r, ["long", "more"])
    out = _pair(r, VARIANT_A="rs_expert", VARIANT_B="rs_expert", TAG_A="long", TAG_B="more",
                SET_A="RS_MIN=16", SET_B="RS_MIN=7 EXPERT_EPISODES=40")
    assert out.returncode == 0, out.stdout + out.stderr
    for tag in ("long", "more"):
        assert json.loads((r / "res" / f"eval_after_{tag}.json").read_text()) == {"tag": tag}
        assert (r / f"chain_{tag}.log").exists()
    timeline = (r / "res" / "timeline.txt").read_text()
    assert "long (rs_expert): 16 min" in timeline and "more (rs_expert): 7 min" in timeline, timeline


def test_two_chains_that_would_share_a_folder_are_refused(tmp_path):
    r = tmp_path / "lr"
    _done_stages(r, ["rs_expert"])
    out = _pair(r, VARIANT_A="rs_expert", VARIANT_B="rs_expert")
    assert out.returncode == 2 and "set TAG_A and TAG_B apart" in out.stderr, out.stdout + out.stderr
    assert not (r / "res" / "eval_after_rs_expert.json").exists()


def _segment(r: Path, mode: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "R": str(r), "TANDEM_PYTHON": "true", "GPU_LOG": "0", **env}
    return subprocess.run(["bash", str(ROOT / "launch" / "libero_segment.sh"), mode], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


def test_segments_hand_the_policy_over_in_parts_and_a_fresh_box_unpacks_them(tmp_path):
    """launch/libero_segment.sh: segment 1 packs its exported policy into parts; on a fresh box
    (another R) the base parts and the policy parts are unpacked, SFT is not rerun, and segment
    2's RL and the protocol start from the carried policy."""
    import tarfile

    r1 = tmp_path / "box1"
    _done_stages(r1, ["seg1"])
    (r1 / "res" / "seg1_status.json").write_text("{}")
    export = r1 / "policy_1"                     # what tools.export writes (TANDEM_PYTHON=true here)
    export.mkdir()
    (export / "model.safetensors").write_bytes(os.urandom(40_000))
    out1 = tmp_path / "out1"
    done = _segment(r1, "rl", SEG="1", OUT=str(out1), RS_S="5")
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(out1.glob("policy.tgz.part*"))
    assert parts and "segment 1: 1 part(s)" in done.stdout
    assert "seg1 (rs): 5 s with" in (r1 / "res" / "timeline.txt").read_text()
    assert len(list(out1.iterdir())) <= 8        # what a lent box returns from one call
    with tarfile.open(out1 / "seg1_logs.tgz") as tar:
        assert "timeline.txt" in tar.getnames()

    base = tmp_path / "base"                     # demos + protocol before, as carried to a new box
    base.mkdir()
    with tarfile.open(base / "base.tgz.part00", "w:gz") as tar:
        for name in ("demos", "before"):
            tar.add(r1 / name, arcname=name)
    r2 = tmp_path / "box2"
    (r2 / "res").mkdir(parents=True)
    (r2 / "res" / "seg2_metrics.jsonl").write_text("")   # segment 2's RL counts as run
    (r2 / "policy_2").mkdir()
    (r2 / "policy_2" / "model.safetensors").write_bytes(b"x")
    done = _segment(r2, "rl", SEG="2", OUT=str(tmp_path / "out2"), START=str(out1), BASE=str(base))
    assert done.returncode == 0, done.stdout + done.stderr
    (started,) = r2.glob("start_*")
    assert (started / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    assert (r2 / "demos" / "meta" / "info.json").exists() and not (r2 / "sft").exists()   # no SFT rerun

    (r2 / "eval3").mkdir()
    (r2 / "eval3" / "eval_report.json").write_text(json.dumps({"overall": {"success": 0.5}}))
    done = _segment(r2, "eval", SEG="3", OUT=str(tmp_path / "out3"), START=str(out1))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "out3" / "eval_3.json").read_text()) == {"overall": {"success": 0.5}}

    bad = _segment(tmp_path / "box3", "rl", SEG="4", START=str(tmp_path / "nothing"))
    assert bad.returncode == 2 and "holds no policy" in bad.stderr, bad.stderr


def test_one_hold_runs_the_protocol_before_beside_the_rl_run(tmp_path):
    """launch/libero_one_hold.sh: both chains run, the RL chain without a sweep before (BEFORE=0),
    the sweep chain without RL, and the end marker holds both exit codes."""
    r = tmp_path / "lr"
    _done_stages(r, ["rs_expert"])
    full = {**os.environ, "R": str(r), "TANDEM_PYTHON": "true", "GPU_LOG": "0", "VARIANT": "rs_expert",
            "RS_S": "900"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_one_hold.sh")], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (r / "res" / "hold_done").read_text().strip() == "before=0 rl=0"
    assert json.loads((r / "res" / "eval_after_rs_expert.json").read_text()) == {"tag": "rs_expert"}
    assert json.loads((r / "res" / "eval_before.json").read_text()) == {"overall": {"success": 0.4}}
    rl_log = (r / "chain_rs_expert.log").read_text()
    assert "no protocol before (BEFORE=0" in rl_log and "rs_expert (rs_expert): 900 s" in rl_log, rl_log
    assert "protocol before RL" in (r / "chain_before.log").read_text()


def test_one_hold_stops_at_once_without_the_kit(tmp_path):
    """A box that came fresh between calls has no kit: the hold stops with exit code 3 before
    any stage runs (not after the stages fail one by one)."""
    r = tmp_path / "lr"
    full = {**os.environ, "R": str(r), "TANDEM_PYTHON": "false", "GPU_LOG": "0", "VARIANT": "rs_expert"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "libero_one_hold.sh")], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "kit check failed" in out.stderr, out.stdout + out.stderr
    assert not (r / "chain_prep.log").exists() and not (r / "res" / "hold_done").exists()
