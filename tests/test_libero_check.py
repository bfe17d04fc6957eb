"""``python -m envs.libero --check`` (issue 13, defect 6): a fresh clone learns in one
command whether LIBERO's assets, a headless render and a forced success work, and, when the
assets are missing, what to do about it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from envs.libero import assets as A
from envs.libero.check import run_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assets_available() -> bool:  # as tests/test_envs_libero.py finds them
    try:
        A.resolve_assets()
        return True
    except (FileNotFoundError, ImportError):
        return False


def _check(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "envs.libero", "--check", *args], cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(not _assets_available(), reason="no LIBERO assets (see envs/libero/assets.py)")
def test_check_passes_with_assets():
    env = {**os.environ, "TANDEM_CACHE_DIR": str(A.cache_root())}  # reuse the extracted assets
    out = _check(env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.split()[:1] in (["ok"], ["FAIL"], ["skip"])]
    assert [ln.split()[:2] for ln in lines] == [["ok", "assets:"], ["ok", "render:"], ["ok", "success:"]]
    assert "2 cameras 64x64" in lines[1] and "reward 1.0, terminated" in lines[2]


def test_missing_assets_name_the_fix(tmp_path, monkeypatch):
    # nothing anywhere: no variable, no LIBERO folder, no ../shared tarball
    for var in ("TANDEM_LIBERO_ASSETS", "TANDEM_LIBERO_ASSETS_TARBALL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(A, "DEV_TARBALL", tmp_path / "no-such.tar.xz")
    if (A.libero_pkg_dir() / "assets").is_dir():
        pytest.skip("LIBERO's own assets folder is installed")
    lines: list[str] = []
    assert run_checks(out=lines.append) == 1
    assert lines[0].startswith("FAIL assets: LIBERO assets not found"), lines
    assert "TANDEM_LIBERO_ASSETS_TARBALL=" in lines[1] and "libero-assets-spatial.tar.xz" in lines[1]
    assert lines[2].startswith("skip render, success") and len(lines) == 3
    # the command line: a variable naming a tarball that is not there -> exit 1, said plainly
    env = {**os.environ, "TANDEM_LIBERO_ASSETS_TARBALL": str(tmp_path / "gone.tar.xz"),
           "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    out = _check(env)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    first, fix = out.stdout.splitlines()[:2]
    assert first == f"FAIL assets: LIBERO assets tarball {tmp_path / 'gone.tar.xz'} does not exist"
    assert fix.strip().startswith("fix: export TANDEM_LIBERO_ASSETS_TARBALL=")
    assert "Traceback" not in out.stderr
