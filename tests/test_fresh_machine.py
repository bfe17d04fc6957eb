"""tools/fresh_machine.py: profiles resolve to the files they hide (a fake tree), unknown and
contradictory profiles are refused, the commands' environment loses exported GL settings; and,
where root and unshare allow it, the hiding really happens in a private namespace only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tandem_testutil import ROOT
from tools import fresh_machine as fm


def _touch(root, folder, *names):
    d = root / folder.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("")


def test_profiles_resolve_to_the_files_they_hide(tmp_path):
    _touch(tmp_path, fm.LIBDIR, "libOSMesa.so.8", "libOSMesa.so.8.0.0", "libEGL.so.1", "libEGL_mesa.so.0",
           "libavcodec.so.59", "libavutil.so.57.28.100", "libavc1394.so.0", "libavahi-client.so.3",
           "libavif.so.15", "libGL.so.1", "libswscale.so.6")
    _touch(tmp_path, "/usr/bin", "ffmpeg", "ffprobe", "python3")
    root = str(tmp_path)
    assert fm.resolve(["egl-only"], root) == {fm.LIBDIR: ["libOSMesa.so.8", "libOSMesa.so.8.0.0"]}
    assert fm.resolve(["osmesa-only"], root) == {fm.LIBDIR: ["libEGL.so.1", "libEGL_mesa.so.0"]}
    assert fm.resolve(["egl-only", "no-ffmpeg"], root) == {
        "/usr/bin": ["ffmpeg", "ffprobe"],
        fm.LIBDIR: ["libOSMesa.so.8", "libOSMesa.so.8.0.0", "libavcodec.so.59", "libavutil.so.57.28.100",
                    "libswscale.so.6"]}
    assert fm.resolve(["none"], root) == {}


def test_unknown_and_contradictory_profiles_are_refused():
    assert fm.parse_profiles(" egl-only , no-ffmpeg,egl-only") == ["egl-only", "no-ffmpeg"]
    with pytest.raises(ValueError, match="unknown profile.*no-osmesa"):
        fm.parse_profiles("egl-only,no-osmesa")
    with pytest.raises(ValueError, match="leave no headless GL"):
        fm.parse_profiles("osmesa-only,egl-only")
    with pytest.raises(ValueError, match="at least one"):
        fm.parse_profiles(" , ")
    r = subprocess.run([sys.executable, "tools/fresh_machine.py", "--hide", "bogus", "--list"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown profile(s) bogus" in r.stderr


def test_arguments_after_the_separator_go_to_pytest():
    a = fm.parse_args(["--hide", "osmesa-only", "--run", "tests", "--", "-q", "tests/test_envs_robot.py"])
    assert a.run == ["tests"] and a.pytest_args == ["-q", "tests/test_envs_robot.py"]
    assert fm.parse_args([]).run == ["demo", "tests"] and fm.parse_args([]).hide == "egl-only,no-ffmpeg"


def test_the_commands_do_not_inherit_a_gl_backend_or_venv():
    env = fm.child_env({"MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl", "VIRTUAL_ENV": "/x",
                        "TANDEM_LIBERO_ASSETS_TARBALL": "/t", "HOME": "/root",
                        "PATH": f"{ROOT}/.venv/bin:/usr/bin"})
    assert env == {"HOME": "/root", "PATH": "/usr/bin"}


@pytest.mark.skipif(fm.can_run() is not None or not shutil.which("mount"),
                    reason=f"needs root, unshare and uv ({fm.can_run()})")
def test_hiding_happens_in_the_namespace_only():
    profiles = ["egl-only", "no-ffmpeg"]
    hidden = [os.path.join(d, n) for d, ns in fm.resolve(profiles).items() for n in ns]
    r = subprocess.run([sys.executable, "tools/fresh_machine.py", "--hide", ",".join(profiles), "--verify-only"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "overlay" in r.stderr and "mount" in r.stderr:
        pytest.skip(f"no overlayfs here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"verified hidden: {len(hidden)} files" in r.stdout
    assert all(os.path.lexists(p) for p in hidden)  # still there outside
