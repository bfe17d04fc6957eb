"""The layering rules, checked on the source: imports point down, and rooms stay small.

    data.core  <-  data  <-  envs, agents  <-  learner, actor  <-  tools

Every import statement counts, also those inside functions (a lazy import is still an
edge) and under ``TYPE_CHECKING``. The core is what both boxes import: no simulator, no model
library in it. Inside agents, an algorithm's package (``agents/sac``, ``ppo``, ``grpo``,
``rs``) imports only the contracts (``agents.core``, ``agents.base``), ``agents.common``,
``agents.parallel`` and data (GRPO builds on PPO); ``agents.common`` only the contracts,
``agents.parallel`` and data. No first-party module imports itself through others (no loops).
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
# algorithm package -> what it may import beyond ALGO_SHARED and itself
ALGO_PACKAGES = {"agents.sac": set(), "agents.ppo": set(), "agents.grpo": {"agents.ppo"}, "agents.rs": set()}
ALGO_SHARED = {"agents.core", "agents.base", "agents.common", "agents.parallel", "data"}
COMMON_ALLOWED = {"agents.core", "agents.base", "agents.common", "agents.parallel", "data"}
# import loops left for now, each with its reason
KNOWN_LOOPS: list[set[str]] = []  # none; a loop added here must say why it stays


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


# -- inside agents: the algorithms' packages --------------------------------------------------------
def _within(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def algorithm_edges_against_the_rules() -> list[str]:
    bad = []
    for path in _product_files():
        name = _module_name(path)
        pkg = next((p for p in ALGO_PACKAGES if _within(name, [p])), None)
        if pkg is not None:
            allowed = ALGO_SHARED | {pkg} | ALGO_PACKAGES[pkg]
        elif _within(name, ["agents.common"]):
            allowed = COMMON_ALLOWED
        else:
            continue
        for line, mod in _imports(path):
            if mod.split(".")[0] in PACKAGES and mod not in PACKAGES and not _within(mod, allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def test_algorithms_import_only_contracts_common_parallel_and_data():
    bad = algorithm_edges_against_the_rules()
    assert not bad, "algorithm packages importing beyond their rules:\n" + "\n".join(bad)


# -- no import loops -------------------------------------------------------------------------------
def import_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (every import statement;
    ``from X import y`` is an edge to ``X.y`` when that is a module, else to ``X``)."""
    files = {_module_name(p): p for p in _product_files()}

    def resolve(mod: str) -> str | None:
        while mod and mod not in files:
            mod = mod.rpartition(".")[0]
        return mod or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = (".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                       if node.level else node.module)
                targets += [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
        graph[name] = {r for t in targets if t.split(".")[0] in PACKAGES and (r := resolve(t)) and r != name}
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    loops: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def test_no_import_loops():
    loops = [sorted(c) for c in import_loops(import_graph()) if c not in KNOWN_LOOPS]
    assert not loops, "modules that import each other (move the shared piece down):\n" + \
        "\n".join(" <-> ".join(c) for c in loops)


def test_the_checkers_catch_a_loop_and_an_algorithm_reaching_sideways(tmp_path, monkeypatch):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    for sub in ("sac", "grpo", "policies"):
        (tmp_path / "agents" / sub).mkdir()
    (tmp_path / "agents" / "a.py").write_text("from agents import b\n")
    (tmp_path / "agents" / "b.py").write_text("def f():\n    from agents.a import X\n")
    (tmp_path / "agents" / "c.py").write_text("from agents import a\n")
    (tmp_path / "agents" / "sac" / "x.py").write_text("from agents.policies.mlp import f\nfrom agents import parallel\n")
    (tmp_path / "agents" / "grpo" / "y.py").write_text("from agents.ppo.agent import PPOAgent\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert import_loops(import_graph()) == [{"agents.a", "agents.b"}]
    bad = algorithm_edges_against_the_rules()
    assert bad == ["agents/sac/x.py:1 imports agents.policies.mlp"], bad

