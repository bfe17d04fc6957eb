"""LIBERO's assets, offline: where they are, extracting a tarball of them once into the cache,
and the set-up that makes ``import libero.libero`` prompt-free (:func:`prepare_libero`).

The assets folder is resolved from, in order: the config's ``assets_path`` (a folder) or
``assets_tarball`` (extracted once into ``~/.cache/tandem/libero-assets/<sha256>``), the
variables ``TANDEM_LIBERO_ASSETS`` / ``TANDEM_LIBERO_ASSETS_TARBALL``, LIBERO's own locations
(``<site-packages>/libero/libero/assets``, ``~/.cache/libero/assets``), and last
``../shared/libero-assets.tar.xz`` next to the checkout (CI and dev machines here). If none
exists this raises with instructions; it never downloads. The folder is handed to LIBERO
through its ``get_assets_path`` cache, so nothing is written into site-packages.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path

from envs.libero.tasks import libero_pkg_dir
from envs.rendering import configure_rendering

ASSET_SUBDIRS = ("articulated_objects", "stable_scanned_objects", "turbosquid_objects",
                 "stable_hope_objects", "scenes")

_REPO_ROOT = Path(__file__).resolve().parents[2]
DEV_TARBALL = _REPO_ROOT.parent / "shared" / "libero-assets.tar.xz"


def cache_root() -> Path:
    """``$TANDEM_CACHE_DIR`` or ``$XDG_CACHE_HOME/tandem`` or ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tandem"


def _file_sha256(path: Path) -> str:
    """sha256 of a file, memoised in the cache by (path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_root() / "libero-assets" / "sha256-memo.json"
    try:
        table = json.loads(memo.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return table[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    table[key] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _find_assets_root(folder: Path) -> Path | None:
    """The folder itself if it holds LIBERO's asset sub-dirs, or its single child that does."""
    if all((folder / d).is_dir() for d in ASSET_SUBDIRS[:4]):
        return folder
    kids = [k for k in folder.iterdir() if k.is_dir()] if folder.is_dir() else []
    if len(kids) == 1 and all((kids[0] / d).is_dir() for d in ASSET_SUBDIRS[:4]):
        return kids[0]
    return None


def extract_assets_tarball(tarball: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Extract a LIBERO assets tarball once into ``<cache>/libero-assets/<sha256>``.

    Safe against concurrent callers (a file lock) and interrupted extractions (extracts into
    a temp dir and renames). Returns the assets root (the folder with ``scenes/`` etc.).
    """
    tarball = Path(tarball).expanduser()
    if not tarball.is_file():
        raise FileNotFoundError(f"LIBERO assets tarball {tarball} does not exist")
    base = Path(cache_dir).expanduser() if cache_dir else cache_root() / "libero-assets"
    digest = _file_sha256(tarball)
    dest = base / digest
    done = dest / ".tandem-complete"
    if not done.exists():
        base.mkdir(parents=True, exist_ok=True)
        with open(base / f"{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=base))
                try:
                    with tarfile.open(tarball) as tf:
                        tf.extractall(tmp, filter="data")
                    root = _find_assets_root(tmp)
                    if root is None:
                        raise ValueError(f"{tarball} holds no LIBERO assets folder ({', '.join(ASSET_SUBDIRS[:4])})")
                    (root / ".tandem-complete").write_text(str(tarball) + "\n")
                    if dest.exists():
                        shutil.rmtree(dest)
                    os.replace(root, dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _asset_dir_ok(p: Path) -> bool:
    return all((p / d).is_dir() for d in ASSET_SUBDIRS[:4])


def resolve_assets(assets_path: str | None = None, assets_tarball: str | None = None) -> Path:
    """Where LIBERO's assets are, extracting a tarball if that is what was given."""
    if assets_path:
        p = Path(assets_path).expanduser()
        if not _asset_dir_ok(p):
            raise FileNotFoundError(
                f"assets_path {p} is not a LIBERO assets folder (needs {', '.join(ASSET_SUBDIRS[:4])})"
            )
        return p.resolve()
    if assets_tarball:
        return extract_assets_tarball(assets_tarball)
    if os.environ.get("TANDEM_LIBERO_ASSETS"):
        return resolve_assets(assets_path=os.environ["TANDEM_LIBERO_ASSETS"])
    if os.environ.get("TANDEM_LIBERO_ASSETS_TARBALL"):
        return extract_assets_tarball(os.environ["TANDEM_LIBERO_ASSETS_TARBALL"])
    for p in (libero_pkg_dir() / "assets", Path.home() / ".cache" / "libero" / "assets"):
        if _asset_dir_ok(p):
            return p.resolve()
    if DEV_TARBALL.is_file():
        return extract_assets_tarball(DEV_TARBALL)
    raise FileNotFoundError(
        "LIBERO assets not found and Tandem never downloads them at run time. Give the env "
        "config an assets_path (a LIBERO assets folder, e.g. one downloaded with LIBERO's "
        "download script) or an assets_tarball (a .tar.* of that folder), or export "
        "TANDEM_LIBERO_ASSETS / TANDEM_LIBERO_ASSETS_TARBALL."
    )


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def ensure_libero_config(assets: Path | None = None) -> Path | None:
    """Point ``LIBERO_CONFIG_PATH`` at a project-written ``config.yaml`` (unless the user
    exported one that exists), so that ``import libero.libero`` never calls ``input()``.
    Runs when :mod:`envs.libero.env` is imported; cheap (no assets needed: LIBERO ignores
    the ``assets`` key, it is written for tools that read it)."""
    user_cfg = os.environ.get("LIBERO_CONFIG_PATH")
    if user_cfg and (Path(user_cfg) / "config.yaml").is_file() and not os.environ.get("_TANDEM_LIBERO_CFG"):
        return None
    try:
        pkg = libero_pkg_dir()
    except ImportError:
        return None
    cfg_dir = cache_root() / "libero-config"
    _write_if_changed(cfg_dir / "config.yaml", "".join(
        f"{k}: {json.dumps(str(v))}\n" for k, v in (
            ("benchmark_root", pkg), ("bddl_files", pkg / "bddl_files"),
            ("init_states", pkg / "init_files"), ("datasets", pkg.parent / "datasets"),
            ("assets", assets or pkg / "assets"),
        )
    ))
    os.environ["LIBERO_CONFIG_PATH"] = str(cfg_dir)
    os.environ["_TANDEM_LIBERO_CFG"] = "1"  # ours: may be rewritten
    return cfg_dir


_prepared_assets: Path | None = None
_prepare_lock = threading.Lock()


def prepare_libero(assets_path: str | None = None, assets_tarball: str | None = None,
                   gl: str | None = "auto") -> Path:
    """Make ``import libero.libero`` prompt-free and offline; return the assets folder."""
    global _prepared_assets
    with _prepare_lock:
        configure_rendering(gl)
        assets = resolve_assets(assets_path, assets_tarball)
        ensure_libero_config(assets)
        import libero.libero as L  # noqa: E402  (after the config exists)

        if _prepared_assets is not None and _prepared_assets != assets:
            import warnings

            warnings.warn(f"LIBERO assets switched from {_prepared_assets} to {assets} in one process",
                          stacklevel=2)
        L._assets_path_cache = str(assets)
        _prepared_assets = assets
        return assets


