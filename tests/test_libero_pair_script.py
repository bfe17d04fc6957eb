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
