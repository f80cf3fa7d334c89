"""The package's imports form no circle: read from the sources (``ast``), not by importing them.

Which imports count: every ``import`` and ``from ... import`` in a module, at module level, inside a function
or under ``if TYPE_CHECKING:``, and ``importlib.import_module("sp_lab....")`` with a literal name.

- Function-level imports count: moving an import into a function defers a circle to the first call, it does
  not remove it (the ``distributed/forkserver`` - ``launch`` - ``rank_processes`` circle ran through one).
- ``TYPE_CHECKING`` imports count: the types a module names are part of its design, and sp_lab resolves
  annotations at run time (``typing.get_type_hints`` reads the typed JSON records), so a circle through a type
  import is one evaluation away from a real one. Left out: a package ``__init__``'s ``TYPE_CHECKING`` block,
  which only names the package's lazy re-exports (``sp_lab.compile`` resolved by ``__getattr__`` on first use)
  for type checkers: the facade sits above everything it re-exports by design.

An edge goes to the module imported: ``from sp_lab.a import b`` to ``sp_lab.a.b`` where that is a module, else
to ``sp_lab.a``. Importing a submodule also runs its packages' ``__init__``; those implied edges are not drawn
(a package's ``__init__`` re-exports its children, so every submodule would close a circle through it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sp_lab"


def module_names(root: Path) -> dict[str, Path]:
    """``sp_lab.x.y`` -> its file, for every module under ``root`` (a package's name for its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every dotted name ``module``'s source imports (candidates: a name may be a module or an attribute)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if is_package and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # a package's lazy re-exports, named for type checkers only
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative: "." is this module's package (the module itself when it is a package's __init__).
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.extend(f"{base}.{alias.name}" for alias in node.names)  # resolved to base where no module
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for which imports count)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for imported in _imported_names(tree, name, path.name == "__init__.py"):
            # `from a import b`: the module a.b if there is one, else a (b is an attribute of a).
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (modules that all reach each other), each as
    a shortest circle through its first module (``[a, b, a]``), sorted: Tarjan's algorithm, then a breadth-first
    path back to the start inside the component. :func:`components` lists every member."""
    return sorted(_circle_through(graph, c) for c in components(graph))


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def _circle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {w: [start, w] for w in sorted(graph[start] & component)}  # breadth first, back to start
    while start not in paths:
        paths = {w: [*path, w] for v, path in sorted(paths.items()) for w in sorted(graph[v] & component)
                 if w not in path[1:] and w not in paths}
    return paths[start]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "sp_lab.distributed.launch" in graph  # the walk found the package
    found = [(_circle_through(graph, c), sorted(c)) for c in components(graph)]
    assert not found, "import cycles in sp_lab: " + "; ".join(
        f"{' -> '.join(circle)} (modules that all reach each other: {', '.join(members)})"
        for circle, members in sorted(found))


# -- the walk itself: it must see what it claims to see ----------------------------------------------------------


@pytest.fixture
def package(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from . import b\n")
    return root


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).write_text(text)


def test_a_function_level_import_closes_a_circle(package):
    _write(package, {"a.py": "from pkg.sub import b\n",
                     "sub/b.py": "def f():\n    from pkg.a import thing\n    return thing\n"})
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_relative_and_import_module_imports_count(package):
    _write(package, {"a.py": "import importlib\ndef f():\n    return importlib.import_module('pkg.c')\n",
                     "c.py": "from .sub.b import x\n",
                     "sub/b.py": "from .. import a\n"})
    assert import_graph(package)["pkg.sub.b"] == {"pkg.a"}
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b", "pkg.a"]]


def test_a_type_checking_import_closes_a_circle(package):
    _write(package, {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import X\n",
                     "sub/b.py": "from pkg.a import y\n"})
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_a_facades_lazy_names_and_implied_package_edges_do_not(package):
    (package / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from pkg.a import f\n")
    _write(package, {"a.py": "import pkg\nVERSION = pkg.__name__\n", "sub/b.py": "from pkg.a import y\n"})
    graph = import_graph(package)
    assert graph["pkg"] == set() and graph["pkg.a"] == {"pkg"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}  # `from . import b` in the package's __init__, and nothing implied
    assert cycles(graph) == []


def test_every_module_of_a_circle_is_named(package):
    _write(package, {"a.py": "from pkg import b\n", "b.py": "from pkg import a, c\n", "c.py": "import pkg.a\n"})
    graph = import_graph(package)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert components(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]
