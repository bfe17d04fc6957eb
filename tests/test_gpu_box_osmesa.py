"""launch/gpu_box.sh with the kit's OSMesa part (tools/gpu_kit.py --osmesa): its .debs unpack under
the site folder, not into /, and ``env`` puts their libraries on the loader's path after the box's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = "usr/lib/x86_64-linux-gnu"


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_the_osmesa_debs_unpack_under_the_site_and_join_the_library_path_last(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text("Package: tandem-fake-osmesa\nVersion: 1.0\nArchitecture: amd64\n"
                                            "Maintainer: tests\nDescription: a stand-in\n")
    name = f"libTandemFakeOSMesa-{os.getpid()}.so.8"
    (pkg / LIB).mkdir(parents=True)
    (pkg / LIB / name).write_bytes(b"\x7fELF stand-in")
    kit, site = tmp_path / "kit", tmp_path / "site"
    (kit / "part1" / "osmesa").mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(kit / "part1" / "osmesa" / "fake.deb")], check=True,
                   capture_output=True)
    env = dict(os.environ, TANDEM_KIT=str(kit), TANDEM_SITE=str(site))
    box = str(ROOT / "launch" / "gpu_box.sh")
    r = subprocess.run(["bash", box, "install"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (site / "osmesa" / LIB / name).read_bytes() == b"\x7fELF stand-in"
    assert not Path("/", LIB, name).exists() and (site / ".installed-part1").exists()
    out = subprocess.run(["bash", box, "env"], env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "LD_LIBRARY_PATH" in ln)
    got = subprocess.run(["bash", "-c", f"{line}; echo $LD_LIBRARY_PATH"], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH="/box/libs")).stdout.strip()
    assert got == f"/box/libs:{site / 'osmesa' / LIB}"
    again = subprocess.run(["bash", box, "install"], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "part1: already installed" in again.stdout
