"""No import circles in ``syncless/``, read from the modules' own import statements.

The graph is built with ``ast`` from the source files, without importing anything:

- A node is a module: ``syncless/a/b.py`` is ``syncless.a.b``, a package's
  ``__init__.py`` is the package itself (``syncless.a``).
- Every ``import`` and ``from ... import`` counts: at module level, inside functions
  and classes, and under ``if TYPE_CHECKING:``. An import deferred into a function
  still says that the module needs the other one, and an import for annotations only
  still says that it knows the other one's types: two modules that know each other
  either way are one design cut in two files (``engine.py`` and ``engine_lifecycle.py``
  were a circle only through ``TYPE_CHECKING``).
- ``import syncless.a.b`` and ``from syncless.a.b import name`` import the module
  ``syncless.a.b``; ``from syncless.a import b`` imports ``syncless.a.b`` when ``b``
  is a submodule, and the package ``syncless.a`` when ``b`` is a name it defines.
- Importing ``syncless.a.b`` runs ``syncless/a/__init__.py`` first, but that is not
  an edge to the package: a package that imports its children to re-export them is
  a table of contents, not a dependency of theirs. A child that imports a *name*
  from its own package (``from syncless.a import X``) does depend on the package's
  ``__init__``, and a circle through it counts.
- ``importlib.import_module`` with a computed name is not seen (it is how
  ``syncless.capture`` loads its torch modules lazily, one way only).

A second test reads the same graph one level up, between the subsystems of
ARCHITECTURE.md (``capture``, ``run``, ``demo``, ``cli``, ...): their dependencies point
one way too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "syncless"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, wherever it is."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def resolve_base(node: ast.ImportFrom, name: str, is_package: bool) -> str | None:
    """The absolute module a ``from`` import names (``None`` outside any package)."""
    if node.level == 0:
        return node.module
    package = name if is_package else name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``syncless`` modules it imports (see the module docstring)."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = resolve_base(node, name, is_package)
                if base is None:
                    continue
                targets = []
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    targets.append(child if child in files else base)
            for target in targets:
                # `import syncless.a.b.c` where c is a name: the nearest module.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, to show in the failure."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    return component


def test_the_checker_finds_a_circle_and_only_the_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_graph_reads_syncless_imports() -> None:
    graph = import_graph()
    assert "syncless.capture.engine" in graph
    # A plain absolute import, seen.
    assert "syncless.hot_path" in graph["syncless"]


def test_no_import_circles_in_syncless() -> None:
    graph = import_graph()
    circles = [
        " -> ".join(a_cycle(graph, c)) + f"  ({len(c)} modules: {', '.join(c)})"
        for c in strongly_connected(graph)
    ]
    assert not circles, "import circles in syncless/:\n" + "\n".join(circles)


def subsystem(module: str) -> str:
    """The part of ``syncless`` a module belongs to: ``syncless.capture.engine`` is in
    ``capture``, ``syncless.hot_path`` is ``hot_path``, the package itself ``syncless``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_circles_between_subsystems() -> None:
    """ARCHITECTURE.md's direction: ``demo`` and ``cli`` use the rest, ``monitors`` use
    ``metrics``, every subsystem may use ``run`` and ``guard``; none uses one that uses it."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(subsystem(module), set())
        for target in targets:
            if subsystem(target) != subsystem(module):
                graph[subsystem(module)].add(subsystem(target))
                graph.setdefault(subsystem(target), set())
    circles = [" -> ".join(a_cycle(graph, c)) for c in strongly_connected(graph)]
    assert not circles, "subsystems of syncless/ that import each other:\n" + "\n".join(circles)
