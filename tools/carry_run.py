"""Carry a learner's run to another machine: pack its run folder into numbered parts of a
bounded size, unpack them elsewhere, and resume there (``resume=auto``) with the curve going on.

A GPU machine that is lent for a bounded time, with bounded uploads and downloads (64 MiB in,
at most 16 MiB a file back, on the boxes Tandem's LIBERO runs use), cannot hold an RL run that
outlasts it, nor move its state in one file. What a run needs to go on elsewhere is in its run
folder: the newest checkpoint (weights, optimizer, counters, policy version, the dataset
position), the LeRobot dataset (the replay and success store are refilled from it), the
metrics (``metrics.jsonl``: ``wall_s`` continues from its last line) and the status files.
``pack`` writes them as one tar stream cut into parts, with a manifest (size and sha256 of each
part and of the whole); ``unpack`` checks every part against the manifest before it extracts
anything, so a missing, short or corrupted part is named and nothing half-written appears::

    python -m tools.carry_run pack runs/rs OUT --part-mib 15          # OUT/rs.part000 ... + OUT/rs.manifest.json
    python -m tools.carry_run unpack OUT runs/rs                      # on the next machine
    python -m learner run_dir=runs/rs ...                             # resumes: "resumed from ..."

Left out by default: older checkpoints (only the one ``checkpoints/latest`` names travels),
logs, wandb files and the actors' spools (unacknowledged records; a run stopped cleanly has
drained them: ``--spool`` takes them along).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Iterator

FORMAT = "tandem-carry/1"
SKIP_DIRS = {"wandb", "spool", "__pycache__"}
SKIP_SUFFIXES = (".log",)


def run_files(run_dir: Path, *, spool: bool = False) -> list[Path]:
    """The files of ``run_dir`` that travel (relative paths, sorted)."""
    run_dir = Path(run_dir)
    ckpt_root = run_dir / "checkpoints"
    latest = (ckpt_root / "latest").read_text().strip() if (ckpt_root / "latest").exists() else None
    out = []
    for p in sorted(run_dir.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        rel = p.relative_to(run_dir)
        top = rel.parts[0]
        if top in SKIP_DIRS and not (spool and top == "spool"):
            continue
        if rel.suffix in SKIP_SUFFIXES or rel.name.startswith(".status.json"):
            continue
        if top == "checkpoints" and len(rel.parts) > 2 and rel.parts[1] != latest:
            continue  # older checkpoints and half-written ones stay
        out.append(rel)
    return out


class _PartWriter(io.RawIOBase):
    """A write-only stream cut into ``<name>.partNNN`` files of at most ``part_bytes``."""

    def __init__(self, out: Path, name: str, part_bytes: int):
        self.out, self.name, self.part_bytes = out, name, part_bytes
        self.parts: list[dict] = []
        self._f = None
        self._h = hashlib.sha256()
        self.whole = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        self._close_part()
        path = self.out / f"{self.name}.part{len(self.parts):03d}"
        self._f, self._h = open(path, "wb"), hashlib.sha256()
        self.parts.append({"file": path.name, "bytes": 0})

    def _close_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts[-1]["sha256"] = self._h.hexdigest()
            self._f = None

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            if self._f is None or self.parts[-1]["bytes"] >= self.part_bytes:
                self._next()
            n = min(len(view) - done, self.part_bytes - self.parts[-1]["bytes"])
            chunk = view[done:done + n]
            self._f.write(chunk)
            self._h.update(chunk)
            self.whole.update(chunk)
            self.parts[-1]["bytes"] += n
            self.size += n
            done += n
        return done

    def close(self) -> None:
        self._close_part()
        super().close()


def pack(run_dir: str | Path, out: str | Path, *, part_mib: float = 15.0, spool: bool = False,
         name: str | None = None) -> dict:
    """Write ``run_dir``'s travelling files into ``out`` as parts of at most ``part_mib`` MiB
    and ``<name>.manifest.json``; returns the manifest."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"carry_run pack: no run folder at {run_dir}")
    if not (run_dir / "checkpoints" / "latest").exists():
        raise ValueError(f"carry_run pack: {run_dir} has no checkpoint (checkpoints/latest): "
                         "stop the learner first (it checkpoints as it stops)")
    if part_mib <= 0:
        raise ValueError(f"--part-mib must be > 0, got {part_mib}")
    name = name or run_dir.name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{name}.part*"):
        old.unlink()
    files = run_files(run_dir, spool=spool)
    writer = _PartWriter(out, name, int(part_mib * 2**20))
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        for rel in files:
            tar.add(run_dir / rel, arcname=str(rel), recursive=False)
    writer.close()
    manifest = {"format": FORMAT, "name": name, "bytes": writer.size, "sha256": writer.whole.hexdigest(),
                "parts": writer.parts, "files": len(files),
                "checkpoint": (run_dir / "checkpoints" / "latest").read_text().strip()}
    (out / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _manifest(src: Path) -> tuple[Path, dict]:
    found = sorted(src.glob("*.manifest.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"carry_run unpack: expected one <name>.manifest.json in {src}, found "
                                f"{[p.name for p in found] or 'none'}")
    m = json.loads(found[0].read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"carry_run unpack: {found[0].name} is not a {FORMAT} manifest")
    return found[0], m


def verify(src: str | Path) -> dict:
    """Check every part named by the manifest in ``src`` (present, size, sha256) and the whole
    stream's hash; raises ValueError / FileNotFoundError naming the first bad part."""
    src = Path(src)
    _, m = _manifest(src)
    whole = hashlib.sha256()
    for part in m["parts"]:
        p = src / part["file"]
        if not p.exists():
            raise FileNotFoundError(f"carry_run: part {part['file']} is missing from {src}")
        if p.stat().st_size != part["bytes"]:
            raise ValueError(f"carry_run: part {part['file']} has {p.stat().st_size} bytes, "
                             f"the manifest says {part['bytes']} (a partial copy?)")
        h = hashlib.sha256()
        for block in _blocks(p):
            h.update(block)
            whole.update(block)
        if h.hexdigest() != part["sha256"]:
            raise ValueError(f"carry_run: part {part['file']} is corrupted (sha256 differs)")
    if whole.hexdigest() != m["sha256"]:
        raise ValueError("carry_run: the parts do not add up to the packed run (sha256 differs)")
    return m


def _blocks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


class _PartReader(io.RawIOBase):
    def __init__(self, paths: list[Path]):
        self._paths, self._f = list(paths), None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")
            n = self._f.readinto(b)
            if n:
                return n
            self._f.close()
            self._f = None


def unpack(src: str | Path, run_dir: str | Path) -> dict:
    """Verify the parts in ``src``, then extract them into ``run_dir`` (which must hold no
    checkpoint yet: a carried run never overwrites another one)."""
    src, run_dir = Path(src), Path(run_dir)
    m = verify(src)
    if (run_dir / "checkpoints" / "latest").exists():
        raise FileExistsError(f"carry_run unpack: {run_dir} already holds a run (checkpoints/latest); "
                              "unpack into an empty folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    reader = io.BufferedReader(_PartReader([src / p["file"] for p in m["parts"]]))
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        tar.extractall(run_dir, filter="data")  # no absolute paths, links out or devices
    return m


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="run folder -> parts + manifest")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--part-mib", type=float, default=15.0, help="largest part (MiB)")
    p.add_argument("--spool", action="store_true", help="take the actors' spools along")
    p.add_argument("--name", default=None, help="file name stem (default: the run folder's name)")
    u = sub.add_parser("unpack", help="parts + manifest -> run folder")
    u.add_argument("src")
    u.add_argument("run_dir")
    v = sub.add_parser("verify", help="check the parts against their manifest")
    v.add_argument("src")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        m = pack(args.run_dir, args.out, part_mib=args.part_mib, spool=args.spool, name=args.name)
    elif args.cmd == "unpack":
        m = unpack(args.src, args.run_dir)
    else:
        m = verify(args.src)
    print(json.dumps({k: m[k] for k in ("name", "bytes", "files", "checkpoint")}
                     | {"parts": len(m["parts"])}))


if __name__ == "__main__":
    main()
