"""Build the kit that a GPU box without internet needs to run LIBERO learners and actors.

A GPU box (torch, transformers and the scientific stack installed; no package index, no
model hub) lacks the simulator and half of Tandem's dependencies. This tool gathers, on a
machine that reaches the package index:

- **wheels** of every package the learner and the LIBERO actors import that the box lacks,
  at the versions ``uv.lock`` pins (``pip download``; a package published only as source is
  built with ``pip wheel``);
- **robosuite, trimmed**: its Python files plus only the data files LIBERO opens (found by
  tracing file opens while every task of ``--suite`` resets, steps and renders here), so its
  590 MB shrink to a few tens;
- **LIBERO's assets** for the suite (a tarball; ``libero-assets-spatial.tar.xz`` for
  libero_spatial);
- **EGL's loader libraries** as Debian packages (``--gl``), for an image without them;
- **OSMesa** (Mesa's software renderer) and the libraries it needs as Debian packages
  (``--osmesa``, ~42 MB), so that simulators on the GPU box can render on its CPU instead of
  the GPU the learner uses (``env.gl=osmesa``); they unpack under the site folder, not into
  ``/``, and ``launch/gpu_box.sh env`` adds them to the loader's path after the box's own.

It writes them into parts of at most ``--part-mib`` (each fits one upload to the box) under
``--out`` with a ``MANIFEST.json`` (files, sizes, sha256). ``launch/gpu_box.sh install``
installs whatever parts are present on the box, part by part, and ``launch/gpu_box.sh start``
starts a learner and N actors::

    python -m tools.gpu_kit --out .kit --assets ../shared/libero-assets-spatial.tar.xz
    # on the box, with .kit/partK carried:  launch/gpu_box.sh install
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]

#: what the box lacks (the GPU image holds ``IMAGE``, below): (package, why)
PACKAGES = (
    ("transformers", "lerobot's PI0 needs the lock's version (the image's is newer)"),
    ("tokenizers", "transformers' pin"),
    ("peft", "LoRA"), ("timm", "OpenVLA's vision backbones"),
    ("lerobot", "PI0 / PI0.5 and the LeRobot dataset"), ("draccus", "lerobot's configs"),
    ("mergedeep", "draccus"), ("toml", "draccus"),
    ("datasets", "LeRobot datasets (buffer, demos)"), ("dill", "datasets"), ("multiprocess", "datasets"),
    ("av", "lerobot's dataset extra: its dataset module refuses to import without it"),
    ("pyzmq", "the wire"), ("lz4", "image codec"),
    ("hydra-core", "configs"), ("omegaconf", "hydra"), ("antlr4-python3-runtime", "omegaconf"),
    ("gymnasium", "envs"), ("farama-notifications", "gymnasium"),
    ("mujoco", "LIBERO's physics"), ("pyopengl", "robosuite's EGL rendering"),
    ("hf-libero", "LIBERO's tasks, BDDL files and init states"), ("bddl", "LIBERO"),
    ("easydict", "LIBERO"), ("termcolor", "robosuite"), ("future", "LIBERO"),
    ("deepspeed", "ZeRO learners (deepspeed.stage)"), ("hjson", "deepspeed"), ("ninja", "deepspeed"),
    ("py-cpuinfo", "deepspeed"), ("einops", "deepspeed"),
    ("pydantic", "deepspeed's configs"), ("pydantic-core", "pydantic"), ("annotated-types", "pydantic"),
    ("typing-inspection", "pydantic"), ("typing-extensions", "pydantic needs a newer one than the image's"),
)
#: what the GPU image already holds (the packages above are what it lacks)
IMAGE = ("torch", "numpy", "scipy", "pandas", "pyarrow", "pillow", "opencv-python", "numba",
         "matplotlib", "accelerate", "safetensors", "huggingface-hub", "aiohttp", "rich", "tqdm",
         "msgpack", "pyyaml", "packaging", "psutil", "filelock", "requests", "jinja2", "sympy",
         "networkx", "fsspec", "triton", "setuptools")
#: Debian packages of the EGL / GL loaders (``--gl``)
GL_DEBS = ("libegl1", "libglvnd0", "libopengl0", "libgl1", "libglx0", "libgles2")
#: Debian 12 packages of OSMesa and what it links that an Ubuntu 24.04 GPU image may lack (``--osmesa``;
#: the image's glibc 2.39 runs them)
OSMESA_DEBS = ("libosmesa6", "libglapi-mesa", "libllvm15", "libz3-4", "libxml2", "libicu72", "libedit2",
               "libbsd0", "libmd0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def lock_versions(lock: Path = ROOT / "uv.lock") -> dict[str, str]:
    return {p["name"]: p["version"] for p in tomllib.loads(lock.read_text())["package"]}


def _pip() -> list[str]:
    """A pip to run (a uv environment has none: then its base interpreter's, or the system's)."""
    for exe in (sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3"),
                "/usr/bin/python3"):
        if exe and subprocess.run([exe, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [exe, "-m", "pip"]
    raise SystemExit("no pip found (python3 -m pip)")


def fetch_wheels(dest: Path, packages: Sequence[str], versions: dict[str, str]) -> list[Path]:
    """Wheels of ``packages`` at the lock's versions for CPython 3.12 on x86-64 Linux."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in packages:
        if name not in versions:
            raise SystemExit(f"{name} is not in uv.lock")
        req = f"{name}=={versions[name]}"
        cmd = [*_pip(), "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), req]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        if subprocess.run(cmd, capture_output=True).returncode != 0:   # source only: build it
            subprocess.run([*_pip(), "wheel", "-q", "--no-deps", "-w", str(dest), req], check=True)
    return sorted(dest.glob("*.whl"))


def trace_opens(suite: str) -> set[str]:
    """Files under robosuite's package that a LIBERO run of every task of ``suite`` opens
    (Python's opens, and the files the compiled MuJoCo model's XML names)."""
    script = f"""
import json, sys, os
import re
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        opened.add(os.path.realpath(args[0]))
sys.addaudithook(hook)
import numpy as np
from envs.libero.env import LiberoEnv
from envs.libero.tasks import list_tasks
for t in range(len(list_tasks({suite!r}))):
    env = LiberoEnv({suite!r}, t, init_state_id=0, image_size=32)
    env.reset(seed=0)
    for _ in range(3):
        env.step(np.zeros(7))
    # MuJoCo's compiler reads meshes and textures in C, unseen by the hook: the model's XML names them
    for m in re.finditer(r'file="([^"]+)"', env._env.env.model.get_xml()):
        opened.add(os.path.realpath(m.group(1)))
    env.close()
import robosuite
root = os.path.realpath(os.path.dirname(robosuite.__file__))
print(json.dumps(sorted(p for p in opened if p.startswith(root + os.sep))))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"tracing LIBERO's file opens failed:\n{out.stderr[-3000:]}")
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def trimmed_robosuite(dest: Path, suite: str) -> Path:
    """robosuite's Python files + dist-info + the data files LIBERO opened, as a .tar.xz that
    unpacks into a site-packages folder."""
    import robosuite

    pkg = Path(robosuite.__file__).resolve().parent
    site = pkg.parent
    opened = trace_opens(suite)
    dist = next(site.glob("robosuite-*.dist-info"))
    out = dest / "robosuite-trimmed.tar.xz"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz") as tar:
        for f in sorted(pkg.rglob("*")):
            if f.is_file() and (f.suffix == ".py" or str(f) in opened or f.name == "macros.py"):
                tar.add(f, arcname=str(f.relative_to(site)))
        tar.add(dist, arcname=dist.name)
    return out


def gl_debs(dest: Path, packages: Sequence[str] = GL_DEBS) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *packages], cwd=dest, check=True, capture_output=True)
    return sorted(dest.glob("*.deb"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_parts(files: list[tuple[Path, str]], out: Path, part_bytes: int) -> list[dict]:
    """Move ``(file, kind)`` into ``out/partK/<kind>/`` folders of at most ``part_bytes``,
    largest first (first fit); returns the manifest entries."""
    parts: list[list[tuple[Path, str]]] = []
    sizes: list[int] = []
    for f, kind in sorted(files, key=lambda x: -x[0].stat().st_size):
        n = f.stat().st_size
        if n > part_bytes:
            raise SystemExit(f"{f.name} ({n / 2**20:.1f} MiB) is larger than a part ({part_bytes / 2**20:.0f} MiB)")
        k = next((i for i, s in enumerate(sizes) if s + n <= part_bytes), None)
        if k is None:
            parts.append([])
            sizes.append(0)
            k = len(parts) - 1
        parts[k].append((f, kind))
        sizes[k] += n
    entries = []
    for i, group in enumerate(parts, 1):
        for f, kind in group:
            target = out / f"part{i}" / kind / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(f), target)
            entries.append({"part": i, "kind": kind, "file": str(target.relative_to(out)),
                            "bytes": target.stat().st_size, "sha256": sha256(target)})
    return entries


def build(out: Path, *, suite: str, assets: Path | None, gl: bool, part_mib: int, osmesa: bool = False) -> dict:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tmp = Path(tmp)
        files = [(w, "wheels") for w in fetch_wheels(tmp / "wheels", [p for p, _ in PACKAGES], lock_versions())]
        files.append((trimmed_robosuite(tmp / "site", suite), "site"))
        if assets is not None:
            copy = tmp / assets.name
            shutil.copy(assets, copy)
            files.append((copy, "assets"))
        if gl:
            files += [(d, "gl") for d in gl_debs(tmp / "gl")]
        if osmesa:
            files += [(d, "osmesa") for d in gl_debs(tmp / "osmesa", OSMESA_DEBS)]
        entries = split_parts(files, out, part_mib * 2**20)
    manifest = {"suite": suite, "python": "3.12", "packages": dict(PACKAGES), "files": entries,
                "parts": max(e["part"] for e in entries),
                "part_mib": {f"part{i}": round(sum(e["bytes"] for e in entries if e["part"] == i) / 2**20, 1)
                             for i in range(1, max(e["part"] for e in entries) + 1)}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    for i in range(1, manifest["parts"] + 1):   # each part carries the manifest, so it installs alone
        shutil.copy(out / "MANIFEST.json", out / f"part{i}" / "MANIFEST.json")
    return manifest


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".kit", help="kit folder (git-ignored; its partK folders are what to carry)")
    ap.add_argument("--suite", default="libero_spatial", help="the LIBERO suite whose files robosuite keeps")
    ap.add_argument("--assets", default=None, help="LIBERO assets tarball to include (e.g. "
                                                   "../shared/libero-assets-spatial.tar.xz)")
    ap.add_argument("--gl", action="store_true", help="include EGL/GL loader .debs (apt-get download)")
    ap.add_argument("--osmesa", action="store_true",
                    help="include OSMesa's .debs: simulators render on the box's CPU (env.gl=osmesa)")
    ap.add_argument("--part-mib", type=int, default=50, help="largest part (the upload limit is 64 MiB "
                                                             "with the repo itself, ~9 MB)")
    args = ap.parse_args(argv)
    manifest = build(Path(args.out), suite=args.suite, assets=Path(args.assets) if args.assets else None,
                     gl=args.gl, part_mib=args.part_mib, osmesa=args.osmesa)
    print(json.dumps({"parts": manifest["part_mib"], "files": len(manifest["files"])}))
    return manifest


if __name__ == "__main__":
    main()
