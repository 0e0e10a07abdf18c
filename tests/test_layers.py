"""The import structure of ``src/shiftguard`` (docs: the "Layers" of the design map).

Every module is parsed with ``ast`` (nothing is imported) and every import statement counts, at module
level or inside a function:

- no module imports a private name (``_name``, or a name from a ``_private`` module) of another
  top-level package: what two packages share is public API of the lower one. The library-wide
  internals at the top (``shiftguard._validation``, ``_lock``, ``_numba``, ``_parallel``,
  ``_progress``) belong to no package and are shared by all;
- the top-level packages and modules (``heads``, ``neighbors``, ``io``, ``cli``, the root package
  itself, ...) form no import cycle;
- no two modules import each other, directly or through others.

Known exceptions are listed by name below, each with the reason it is still there; a fix removes
its entry (``test_every_allowed_exception_still_exists`` fails until it does).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "shiftguard"

#: (importing module, imported module, name) allowed to cross a package boundary although private:
#: none.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

#: Package-level cycles allowed, as sorted tuples of the top-level names in one cycle: none.
ALLOWED_PACKAGE_CYCLES: set[tuple[str, ...]] = set()

#: Module-level cycles allowed, as sorted tuples of module names in one cycle: none.
ALLOWED_MODULE_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) for every module under ``src/shiftguard``."""
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import in ``module`` that resolves
    into ``shiftguard``: ``from a.b import c`` gives module ``a.b.c`` when that is a module, else
    ``a.b`` with name ``c``; relative imports are resolved against ``module``."""
    path, is_pkg = MODULES[module]
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (base, alias.name, node.lineno))
    return [(target, name, line) for target, name, line in out if target == ROOT or target.startswith(ROOT + ".")]


def _top(module: str) -> str:
    """The top-level package or module of ``module`` (``shiftguard`` for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports() -> set[tuple[str, str, str]]:
    """Imports of another top-level package's private names or modules, as (importer, module, name)."""
    found = set()
    for module in MODULES:
        for target, name, _ in _imports(module):
            if _top(target) == _top(module):
                continue
            # Below the top level: any private module on the path, or a private imported name.
            private_path = [p for p in target.split(".")[2:] if _is_private(p)]
            if private_path or (name is not None and _is_private(name)):
                found.add((module, target, name or target.rpartition(".")[2]))
    return found


def _cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components with more than one node (Tarjan), as sorted tuples."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def package_cycles() -> set[tuple[str, ...]]:
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _, _ in _imports(module):
            if _top(target) != _top(module):
                edges.setdefault(_top(module), set()).add(_top(target))
    return _cycles(edges)


def module_cycles() -> set[tuple[str, ...]]:
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _, _ in _imports(module):
            if target in MODULES and target != module:
                edges.setdefault(module, set()).add(target)
    return _cycles(edges)


def test_the_parser_sees_the_whole_package():
    assert {"shiftguard.neighbors.search", "shiftguard.heads.ned", "shiftguard.cli"} <= set(MODULES)
    targets = {(t, n) for t, n, _ in _imports("shiftguard.heads.ned")}
    assert ("shiftguard.neighbors", "knn_search") in targets
    assert ("shiftguard.functional.scaling", "ldexp") in targets


def test_no_module_imports_another_packages_private_names():
    leaks = private_imports() - ALLOWED_PRIVATE_IMPORTS
    assert not leaks, "private names imported across packages: " + ", ".join(
        f"{m} imports {n} from {t}" for m, t, n in sorted(leaks)
    )


def test_neighbors_imports_only_the_library_internals():
    # neighbors sits below heads, metrics and uncertainty, which all search through it; below it
    # only the library-wide internals it uses (validation, the compiled kernels' helpers).
    outside = {
        (m, t)
        for m in MODULES
        if _top(m) == "neighbors"
        for t, _, _ in _imports(m)
        if _top(t) not in ("neighbors", "_validation", "_numba", "_parallel")
    }
    assert not outside, f"neighbors imports a higher layer: {sorted(outside)}"


def test_top_level_packages_form_no_import_cycle():
    cycles = package_cycles() - ALLOWED_PACKAGE_CYCLES
    assert not cycles, f"import cycles between top-level packages: {sorted(cycles)}"


def test_modules_form_no_import_cycle():
    cycles = module_cycles() - ALLOWED_MODULE_CYCLES
    assert not cycles, f"import cycles between modules: {sorted(cycles)}"


@pytest.mark.parametrize(
    "allowed, found",
    [
        (ALLOWED_PRIVATE_IMPORTS, private_imports),
        (ALLOWED_PACKAGE_CYCLES, package_cycles),
        (ALLOWED_MODULE_CYCLES, module_cycles),
    ],
    ids=["private-imports", "package-cycles", "module-cycles"],
)
def test_every_allowed_exception_still_exists(allowed, found):
    stale = allowed - found()
    assert not stale, f"fixed, remove from the allow-list: {sorted(stale)}"


def test_the_checks_detect_a_leak_and_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / ROOT
    for sub, text in {
        "__init__.py": "",
        "low/__init__.py": "from shiftguard.low.impl import _secret\n",
        "low/impl.py": "def _secret():\n    from shiftguard.high import api  # a function-level import counts\n",
        "high/__init__.py": "",
        "high/api.py": "from shiftguard.low.impl import _secret\n",
    }.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "SRC", tmp_path)
    monkeypatch.setattr(this, "MODULES", _modules())
    assert private_imports() == {("shiftguard.high.api", "shiftguard.low.impl", "_secret")}
    assert package_cycles() == {("high", "low")}
    assert module_cycles() == {("shiftguard.high.api", "shiftguard.low.impl")}
