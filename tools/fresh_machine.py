"""Run the README's two commands as on a fresh machine that lacks some system libraries.

    python tools/fresh_machine.py --hide egl-only,no-ffmpeg              # demo + full suite
    python tools/fresh_machine.py --hide egl-only,no-ffmpeg --run tests -- -q   # full suite only
    python tools/fresh_machine.py --hide osmesa-only --run tests -- -q tests/test_envs_robot.py
    python tools/fresh_machine.py --hide egl-only,no-ffmpeg --run demo
    python tools/fresh_machine.py --hide egl-only --list                 # what would be hidden
    python tools/fresh_machine.py --hide egl-only,no-ffmpeg --verify-only # hide + check, nothing run
    python tools/fresh_machine.py --hide no-ffmpeg --run '' --exec 'uv run --frozen python -c ...'

Profiles (comma-separated, they combine):

    egl-only     hide OSMesa (Debian libosmesa6): rendering must work through EGL alone
    osmesa-only  hide EGL (libegl1, libegl-mesa0, libegl-dev): OSMesa alone
    no-ffmpeg    hide the system FFmpeg (ffmpeg's programs, libavcodec/-format/-util/-device/
                 -filter, libswscale, libswresample, libpostproc): only the wheels' own copies
    none         hide nothing (a clean-clone baseline)

How (needs root and util-linux ``unshare``; nothing outside changes): the tool re-runs itself
in a private mount namespace (``unshare --mount --propagation private``). There it overlays
each folder that holds a file to hide (``/usr/lib/<multiarch>``, ``/usr/bin``, ...) with an
overlayfs whose upper folder holds a whiteout (``mknod NAME c 0 0``) per hidden file, binds a
regenerated ``ld.so.cache`` (``ldconfig -X -C``) over ``/etc/ld.so.cache`` so that
``ctypes.util.find_library`` does not see the hidden libraries either, and checks that they are
gone (no path, ``dlopen`` of each hidden soname fails, ``find_library`` finds nothing). Then it
``git clone``s this checkout's HEAD (committed work only: a clean clone, like CI; ``--rev`` for
another) into a temporary folder, links ``../shared`` beside it (LIBERO's asset tarball), runs
``uv sync --frozen`` and then, in the clone, with ``MUJOCO_GL``, ``PYOPENGL_PLATFORM``,
``VIRTUAL_ENV`` and ``TANDEM_*`` removed from the environment (the code's own auto-detection is
what gets tested):

    uv run --frozen launch/demo.sh          (--run demo)
    uv run --frozen pytest <args>           (--run tests; <args> after ``--``, default -q)

It prints each command's exit code and wall time, and exits non-zero when one fails. The
clone is removed afterwards unless ``--keep``. Stdlib only: runs under any Python 3.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSIDE_FLAG = "--_inside-namespace"
LIBDIR = f"/usr/lib/{sysconfig.get_config_var('MULTIARCH') or 'x86_64-linux-gnu'}"

_FFMPEG_LIBS = ("avcodec", "avformat", "avutil", "avdevice", "avfilter", "swscale", "swresample",
                "postproc")
# profile -> (folder, file-name glob) pairs to hide; sonames (probe) must then fail to dlopen,
# library names (find) must not be found by ctypes.util.find_library, programs not on PATH.
PROFILES: dict[str, dict] = {
    "egl-only": {
        "hide": [(LIBDIR, "libOSMesa.so*"), (LIBDIR, "libOSMesa.so")],
        "probe": ["libOSMesa.so.8", "libOSMesa.so.6"], "find": ["OSMesa"], "programs": [],
    },
    "osmesa-only": {
        "hide": [(LIBDIR, "libEGL.so*"), (LIBDIR, "libEGL_mesa.so*"),
                 ("/usr/share/glvnd/egl_vendor.d", "50_mesa.json")],
        "probe": ["libEGL.so.1", "libEGL_mesa.so.0"], "find": ["EGL"], "programs": [],
    },
    "no-ffmpeg": {
        "hide": [(LIBDIR, f"lib{n}.so*") for n in _FFMPEG_LIBS]
        + [("/usr/bin", p) for p in ("ffmpeg", "ffprobe", "ffplay", "qt-faststart")],
        "probe": ["libavutil.so.57", "libavcodec.so.59", "libavformat.so.59"],
        "find": list(_FFMPEG_LIBS), "programs": ["ffmpeg", "ffprobe"],
    },
    "none": {"hide": [], "probe": [], "find": [], "programs": []},
}
CONFLICTS = [{"egl-only", "osmesa-only"}]
DROP_ENV = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT")


def parse_profiles(text: str) -> list[str]:
    """``"egl-only, no-ffmpeg"`` -> ``["egl-only", "no-ffmpeg"]``; unknown or conflicting
    names raise ValueError."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("--hide needs at least one profile (use 'none' to hide nothing)")
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise ValueError(f"unknown profile(s) {', '.join(unknown)}; known: {', '.join(PROFILES)}")
    for bad in CONFLICTS:
        if bad <= set(names):
            raise ValueError(f"profiles {' and '.join(sorted(bad))} together leave no headless GL")
    return list(dict.fromkeys(names))


def resolve(profiles: list[str], root: str = "/") -> dict[str, list[str]]:
    """Folder -> sorted names of the existing files (links included) the profiles hide.
    ``root`` prefixes the folders (tests point it at a fake tree); keys stay absolute."""
    out: dict[str, set[str]] = {}
    for prof in profiles:
        for folder, pattern in PROFILES[prof]["hide"]:
            real = os.path.join(root, folder.lstrip("/"))
            try:
                names = os.listdir(real)
            except FileNotFoundError:
                continue
            hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
            if hits:
                out.setdefault(folder, set()).update(hits)
    return {k: sorted(v) for k, v in sorted(out.items())}


def child_env(base: dict[str, str]) -> dict[str, str]:
    """The commands' environment: no exported GL backend, venv or Tandem setting."""
    env = {k: v for k, v in base.items() if k not in DROP_ENV and not k.startswith("TANDEM_")}
    venv = str(REPO / ".venv")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    return env


def _say(msg: str) -> None:
    print(f"fresh_machine: {msg}", flush=True)


# ----------------------------------------------------------------- inside the namespace
def _hide(hidden: dict[str, list[str]], scratch: Path) -> None:
    """Overlay each folder with whiteouts for its hidden names; regenerate ld.so.cache."""
    scratch.mkdir(parents=True, exist_ok=True)  # also when nothing is left to hide (nested)
    for i, (folder, names) in enumerate(hidden.items()):
        upper, work = scratch / f"ov{i}" / "upper", scratch / f"ov{i}" / "work"
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        for n in names:
            os.mknod(upper / n, 0o600 | 0o020000, os.makedev(0, 0))  # S_IFCHR 0:0 = whiteout
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={folder},upperdir={upper},workdir={work}", folder], check=True)
    cache = scratch / "ld.so.cache"
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    subprocess.run([ldconfig, "-X", "-C", str(cache)], check=True)
    if os.path.exists("/etc/ld.so.cache"):
        subprocess.run(["mount", "--bind", str(cache), "/etc/ld.so.cache"], check=True)


_PROBE = r"""
import ctypes, ctypes.util, shutil, sys
sonames, finds, progs = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3].split()
bad = []
for s in sonames:
    try:
        ctypes.CDLL(s)
        bad.append("dlopen " + s)
    except OSError:
        pass
bad += ["find_library %s -> %s" % (f, ctypes.util.find_library(f)) for f in finds
        if ctypes.util.find_library(f)]
bad += ["program %s -> %s" % (p, shutil.which(p)) for p in progs if shutil.which(p)]
print("\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _verify(profiles: list[str], hidden: dict[str, list[str]], python: str) -> None:
    left = [os.path.join(d, n) for d, ns in hidden.items() for n in ns if os.path.lexists(os.path.join(d, n))]
    if left:
        raise SystemExit(f"fresh_machine: still visible after hiding: {left}")
    sonames = [s for p in profiles for s in PROFILES[p]["probe"]]
    finds = [f for p in profiles for f in PROFILES[p]["find"]]
    progs = [x for p in profiles for x in PROFILES[p]["programs"]]
    r = subprocess.run([python, "-c", _PROBE, " ".join(sonames), " ".join(finds), " ".join(progs)],
                       capture_output=True, text=True, env=child_env(dict(os.environ)))
    if r.returncode != 0:
        raise SystemExit(f"fresh_machine: hidden libraries still load: {r.stdout.strip()} {r.stderr.strip()}")
    _say(f"verified hidden: {sum(map(len, hidden.values()))} files; dlopen fails for "
         f"{', '.join(sonames) or '-'}; find_library finds none of {', '.join(finds) or '-'}")


def _timed(label: str, cmd: list[str], cwd: Path, env: dict[str, str], results: list) -> int:
    _say(f"$ {' '.join(cmd)}   (in {cwd})")
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=cwd, env=env).returncode
    dt = time.monotonic() - t0
    results.append((label, rc, dt))
    _say(f"{label}: exit {rc} in {dt:.1f} s")
    return rc


def inside(args: argparse.Namespace) -> int:
    profiles = parse_profiles(args.hide)
    hidden = resolve(profiles)
    scratch = Path(tempfile.mkdtemp(prefix="tandem-fresh-", dir=args.tmp))
    results: list[tuple[str, int, float]] = []
    try:
        _hide(hidden, scratch / "overlay")
        _verify(profiles, hidden, sys.executable)
        if args.verify_only:
            results.append(("verify", 0, 0.0))
            return 0
        env = child_env(dict(os.environ))
        clone = scratch / "main"
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
        if args.rev:
            subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", args.rev], check=True)
        head = subprocess.run(["git", "-C", str(clone), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True).stdout.strip()
        _say(f"clone of {REPO} at {head[:100]}")
        shared = REPO.parent / "shared"
        if shared.is_dir():
            (scratch / "shared").symlink_to(shared)
        if not env.get("UV_PYTHON") and (clone / "launch" / "find_python.sh").exists():
            # the README's step for a Python 3.12 that uv does not find by itself (pyenv)
            found = subprocess.run(["bash", "-c", "source launch/find_python.sh >&2 && echo $UV_PYTHON"],
                                   cwd=clone, env=env, capture_output=True, text=True).stdout.strip()
            if found:
                env["UV_PYTHON"] = found
                _say(f"UV_PYTHON={found} (from launch/find_python.sh, as the README says)")
        if _timed("uv sync", ["uv", "sync", "--frozen"], clone, env, results) != 0:
            return 1
        if "demo" in args.run:
            _timed("demo", ["uv", "run", "--frozen", "launch/demo.sh", *args.demo_args], clone, env, results)
        if args.exec:
            _timed("exec", ["bash", "-c", args.exec], clone, env, results)
        if "tests" in args.run:
            _timed("tests", ["uv", "run", "--frozen", "pytest", *(args.pytest_args or ["-q"])], clone, env,
                   results)
    finally:
        _say(f"profiles {','.join(profiles)}: " + "; ".join(f"{lbl} exit {rc} in {dt:.1f} s"
                                                            for lbl, rc, dt in results))
        if args.keep:
            _say(f"kept {scratch} (its overlays are gone with the namespace; the clone stays)")
        else:
            shutil.rmtree(scratch / "main", ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if results and all(rc == 0 for _, rc, _ in results) else 1


# ----------------------------------------------------------------- outside
def can_run() -> str | None:
    """None when this machine can make the namespace, else why not."""
    if os.geteuid() != 0:
        return "needs root (mount namespace + overlayfs)"
    if not shutil.which("unshare"):
        return "needs util-linux unshare"
    if not shutil.which("uv"):
        return "needs uv on PATH"
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Arguments after -- go to pytest (default -q).")
    ap.add_argument("--hide", default="egl-only,no-ffmpeg",
                    help=f"comma-separated profiles: {', '.join(PROFILES)} (default egl-only,no-ffmpeg)")
    ap.add_argument("--run", default="demo,tests", help="demo, tests or demo,tests (default both)")
    ap.add_argument("--demo-arg", dest="demo_args", action="append", default=[],
                    help="an override passed to launch/demo.sh (repeatable)")
    ap.add_argument("--exec", default=None, metavar="SHELL",
                    help="also run this bash command in the clone, after the demo (debugging)")
    ap.add_argument("--rev", default=None, help="commit to check out in the clone (default HEAD)")
    ap.add_argument("--tmp", default=None, help="where the clone goes (default $TMPDIR or /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the clone afterwards")
    ap.add_argument("--list", action="store_true", help="print what would be hidden and exit")
    ap.add_argument("--verify-only", action="store_true",
                    help="hide, check that the files are gone, and stop (no clone, no commands)")
    ap.add_argument(INSIDE_FLAG, dest="inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.pytest_args = pytest_args
    try:
        parse_profiles(args.hide)
    except ValueError as exc:
        ap.error(str(exc))
    args.run = [r.strip() for r in args.run.split(",") if r.strip()]
    if (not args.run and not args.exec and not args.verify_only) or set(args.run) - {"demo", "tests"}:
        ap.error(f"--run takes demo, tests or both; got {args.run}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inside:
        return inside(args)
    profiles = parse_profiles(args.hide)
    hidden = resolve(profiles)
    if args.list:
        for folder, names in hidden.items():
            print(f"{folder}: {' '.join(names)}")
        return 0
    why = can_run()
    if why:
        print(f"fresh_machine: {why}", file=sys.stderr)
        return 2
    _say(f"hiding {sum(map(len, hidden.values()))} files for {','.join(profiles)} in a private mount "
         "namespace")
    rc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                         str(Path(__file__).resolve()), INSIDE_FLAG, *argv]).returncode
    still = [os.path.join(d, n) for d, ns in hidden.items() for n in ns if not os.path.lexists(os.path.join(d, n))]
    if still:  # must never happen: the overlays live in the namespace only
        print(f"fresh_machine: WARNING files missing outside the namespace: {still}", file=sys.stderr)
        return 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
