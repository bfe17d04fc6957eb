"""The layering rules, checked on the source: imports point down, and rooms stay small.

    data.core  <-  data  <-  envs, agents  <-  learner, actor  <-  tools

Every import statement counts, also those inside functions (a lazy import is still an
edge). The core is what both boxes import: no simulator, no model library in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "envs", "agents", "learner", "actor", "tools")

# package -> first-party packages it may import (itself included)
ALLOWED = {
    "data.core": {"data.core"},
    "data": {"data"},
    "envs": {"data", "envs"},
    "agents": {"data", "agents"},
    "learner": {"data", "envs", "agents", "learner"},
    "actor": {"data", "envs", "agents", "actor"},
    "tools": set(PACKAGES),
}
# third-party modules the core must not pull onto either box
CORE_FORBIDDEN = {"gymnasium", "mujoco", "robosuite", "libero", "gym_hil", "transformers",
                  "lerobot", "peft", "timm", "accelerate", "deepspeed", "torchvision"}
MAX_LINES = 500


def _layer(module: str) -> str:
    return "data.core" if module == "data.core" or module.startswith("data.core.") else module.split(".")[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path).split(".")
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
                out += [(node.lineno, m) for m in names]
            elif node.module:
                out.append((node.lineno, node.module))
                # "from data import core" is an edge to data.core
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                        if node.module in PACKAGES]
    return out


def _product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def edges_against_the_rules() -> list[str]:
    bad = []
    for path in _product_files():
        src_layer = _layer(_module_name(path))
        allowed = ALLOWED[src_layer]
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            rel = f"{path.relative_to(ROOT)}:{line} imports {mod}"
            if top in PACKAGES:
                dst = _layer(mod)
                ok = dst in allowed or (src_layer == "data" and dst == "data.core") \
                    or (dst == "data.core" and "data" in allowed)
                if not ok:
                    bad.append(rel)
            elif src_layer == "data.core" and top in CORE_FORBIDDEN:
                bad.append(rel + " (the core imports no simulator or model library)")
    return bad


def test_imports_point_down():
    bad = edges_against_the_rules()
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_the_checker_catches_a_wrong_edge(tmp_path, monkeypatch):
    """The rule check itself: an actor module importing the learner is reported."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "data" / "core").mkdir()
    (tmp_path / "actor" / "bad.py").write_text("def f():\n    from learner.service import X\n")
    (tmp_path / "data" / "core" / "bad.py").write_text("import gymnasium\nfrom data import replay\n")
    (tmp_path / "agents" / "ok.py").write_text("from data.core.spec import EnvSpec\nfrom . import base\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = edges_against_the_rules()
    assert any("actor/bad.py:2 imports learner.service" in b for b in bad)
    assert any("data/core/bad.py:1 imports gymnasium" in b for b in bad)
    assert any("data/core/bad.py:2 imports data.replay" in b for b in bad)
    assert not any("agents/ok.py" in b for b in bad)


def test_no_module_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _product_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(long)
