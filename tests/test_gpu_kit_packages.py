"""The GPU kit lists every package deepspeed needs that the GPU image lacks.

A box once had deepspeed installed from the kit but not pydantic: ``accelerate launch`` with
a DeepSpeed config died on ``import deepspeed``. This walks the installed metadata (no
network) from the kit's packages through their unconditional requirements.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, requires

from tools.gpu_kit import IMAGE, PACKAGES, lock_versions


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _needs(dist: str) -> set[str]:
    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        return set()
    out = set()
    for r in reqs:
        if ";" in r and "extra" in r.split(";", 1)[1]:
            continue
        out.add(_norm(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]))
    return out


def test_every_requirement_of_deepspeed_is_in_the_kit_or_the_image():
    kit = {_norm(p) for p, _ in PACKAGES}
    have = kit | {_norm(p) for p in IMAGE}
    todo, seen, missing = ["deepspeed"], set(), set()
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        for need in _needs(d):
            if need not in have:
                missing.add(f"{need} (needed by {d})")
            elif need in kit:
                todo.append(need)
    assert "pydantic" in seen, seen
    assert not missing, sorted(missing)


def test_every_kit_package_is_pinned_by_the_lock():
    versions = lock_versions()
    assert [p for p, _ in PACKAGES if p not in versions] == []
