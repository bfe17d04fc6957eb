"""Make CURVE certificates for the learner and its actors.

    python -m tools.gen_keys KEYS_DIR learner arm-1 arm-2

writes ``KEYS_DIR/<name>.key`` (public) and ``KEYS_DIR/<name>.key_secret`` (secret) for each
name, and copies every non-learner public key into ``KEYS_DIR/actors/`` - the folder the
learner's ``transport.security.authorized_keys_dir`` points at. Give each actor its own
``.key_secret`` and the learner's ``.key``; keep secrets off shared disks.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import zmq.auth


def make_keys(keys_dir: str | Path, names: list[str], learner: str = "learner") -> dict[str, tuple[Path, Path]]:
    keys_dir = Path(keys_dir)
    keys_dir.mkdir(parents=True, exist_ok=True)
    (keys_dir / "actors").mkdir(exist_ok=True)
    out = {}
    for name in names:
        if "/" in name or not name:
            raise ValueError(f"bad key name {name!r}")
        public, secret = zmq.auth.create_certificates(str(keys_dir), name)
        out[name] = (Path(public), Path(secret))
        Path(secret).chmod(0o600)
        if name != learner:
            shutil.copy(public, keys_dir / "actors" / Path(public).name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("keys_dir")
    ap.add_argument("names", nargs="+", help="the learner's name first by convention ('learner'), then actors")
    args = ap.parse_args()
    for name, (pub, sec) in make_keys(args.keys_dir, args.names).items():
        print(f"{name}: {pub} (public), {sec} (secret)")


if __name__ == "__main__":
    main()
