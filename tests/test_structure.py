"""The package's shape: no import cycle between voicepipe's modules, no module over 600 lines, and no
function-local import of a voicepipe module outside the CLI (a lazy import that dodges a cycle hides it).

The import graph is read from the source (the AST), not from ``sys.modules``: every ``import`` and
``from ... import`` anywhere in a module, top-level or inside a function, except under
``if TYPE_CHECKING:`` (annotations only, never executed). ``from pkg import name`` is an edge to the module
``pkg.name`` where that is a module, else to ``pkg``. The CLI's modules (``voicepipe.cli`` and its package's
modules) may import lazily, for start-up time; anyone may import a module of an optional extra lazily
(:data:`OPTIONAL_EXTRA`: importing it needs a package a plain install does not have).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "voicepipe"
MAX_LINES = 600
# modules the checks skip (none: every module is checked)
SKIP: set[str] = set()
# modules that import an optional extra at their top: imported lazily, only when the extra is asked for
OPTIONAL_EXTRA = {"voicepipe.parallel_ray": "ray"}


@dataclass(frozen=True)
class Edge:
    target: str
    line: int
    local: bool  # inside a function body


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, local: bool = False) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import under ``node`` (with whether it sits in a function), skipping TYPE_CHECKING blocks."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:  # the else branch does run
                found += _imports(sub, local)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append((child, local))
        inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        found += _imports(child, inner)
    return found


def edges(name: str, path: Path, known: set[str]) -> list[Edge]:
    is_pkg = path.name == "__init__.py"
    out: list[Edge] = []
    for node, local in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            # `import voicepipe.a.b` names voicepipe.a.b; a name that is no module of ours is skipped
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                out.append(Edge(t, node.lineno, local))
    return out


def graph() -> dict[str, list[Edge]]:
    mods = modules()
    known = set(mods)
    return {name: edges(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, list[Edge]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) for every strongly connected component of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def strong(v: str) -> None:  # Tarjan (the graph has ~100 nodes: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for e in g[v]:
            if e.target not in index:
                strong(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(g):
        if v not in index:
            strong(v)
    out = []
    for comp in comps:
        start = min(comp)
        # breadth-first back to start inside the component: the shortest cycle through it
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for e in g[v]:
                    if e.target == start:
                        found = v
                        break
                    if e.target in comp and e.target not in prev and e.target != start:
                        prev[e.target] = v
                        nxt.append(e.target)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev.get(v)
        out.append([*path, start])
    return out


def is_cli(name: str) -> bool:
    return name == "voicepipe.cli" or name.startswith("voicepipe.cli.")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_import_cycle_between_voicepipe_modules():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_is_longer_than_600_lines():
    long = {
        rel(p): n
        for p in modules().values()
        if rel(p) not in SKIP and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_library_code_imports_voicepipe_modules_at_the_top_only():
    mods = modules()
    lazy = [
        f"{rel(mods[name])}:{e.line} imports {e.target} inside a function"
        for name, es in graph().items()
        if not is_cli(name) and rel(mods[name]) not in SKIP
        for e in es
        if e.local and e.target not in OPTIONAL_EXTRA
    ]
    assert not lazy, "\n".join(lazy)


def test_the_structure_checks_see_cycles_and_lazy_imports(tmp_path, monkeypatch):
    """The checks themselves: a two-module circle through a function-local import is found and named,
    a TYPE_CHECKING import is not an edge."""
    pkg = tmp_path / "voicepipe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from voicepipe.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from voicepipe import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from voicepipe import a\nfrom . import a as x\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", pkg)
    g = graph()
    assert cycles(g) == [["voicepipe.a", "voicepipe.sub.b", "voicepipe.a"]]
    assert [(e.target, e.local) for e in g["voicepipe.sub.b"]] == [("voicepipe.a", True)]
    assert [(e.target, e.line) for e in g["voicepipe.c"]] == [("voicepipe.a", 4)]
