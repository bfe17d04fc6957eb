"""Shared test helpers (a uniquely named module: some installed package ships a top-level
``tests`` package, so ``tests.conftest`` cannot be imported by name)."""

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
