"""The module import graph of source trees, read from their syntax trees (nothing is imported).

Every ``import`` statement counts: at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING:``; each :class:`Edge` says which. Two dynamic forms count too, because they load a module
just like an import statement: ``importlib.import_module("literal")``, and in a module that defines a
module-level ``__getattr__`` (a PEP 562 lazy facade such as ``tokenmill.plugin_api``) every string constant
that names a module of the graph. ``"module:Class"`` strings handed to a registry are not edges: they are late
binding by design (the registry resolves them when asked), which is how lower layers name defaults that live
higher up.

An import of ``a.b.c`` is an edge to the longest prefix that is a module of the graph (``from a.b import c``
reaches the submodule ``a.b.c`` when there is one, else the package ``a.b``). The parent packages that Python
initialises on the way are not edges: a package ``__init__`` is a module of its own with its own edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TOP_LEVEL = "top"
LAZY = "lazy"  # inside a function (or a class body's method): runs when called
TYPE_ONLY = "type-checking"  # under ``if TYPE_CHECKING:``: never runs
DYNAMIC = "dynamic"  # importlib.import_module("...") or a lazy facade's module name


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` of ``path``; ``kind`` is one of the module constants.
    ``imported`` is the absolute name as written (``target`` is the longest prefix of it that is a module)."""

    source: str
    target: str
    line: int
    kind: str
    path: Path
    imported: str

    def where(self, root: Path) -> str:
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"


@dataclass
class ImportGraph:
    """Modules (dotted name -> file) and the edges between them (imports of anything else are dropped)."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def edges_from(self, module: str) -> list[Edge]:
        return [e for e in self.edges if e.source == module]

    def adjacency(self, kinds: Iterable[str] | None = None) -> dict[str, set[str]]:
        wanted = set(kinds) if kinds is not None else None
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            if e.source != e.target and (wanted is None or e.kind in wanted):
                out[e.source].add(e.target)
        return out


def discover(trees: dict[Path, str]) -> dict[str, Path]:
    """Module name -> file for every ``*.py`` under each folder, the folder being the package ``trees[folder]``
    (``""``: the folder is a source root whose files and subfolders are top-level modules and packages).
    Build outputs (``build/``, ``*.egg-info``) are skipped."""
    out: dict[str, Path] = {}
    for folder, package in trees.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if any(part == "build" or part.endswith(".egg-info") or part.startswith(".") for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(([package] if package else []) + parts)
            if name:
                out[name] = path
    return out


def build_graph(modules: dict[str, Path]) -> ImportGraph:
    """Parse every module of ``modules`` and collect its imports (see the module docstring)."""
    graph = ImportGraph(modules=dict(modules))
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for line, imported, kind in _imports(tree, name, is_package, set(modules)):
            target = _resolve(imported, modules)
            if target is not None:
                graph.edges.append(Edge(name, target, line, kind, path, imported))
    return graph


def find_cycles(adjacency: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component of more than one module, or of
    one module that imports itself; sorted, so the report is stable."""
    cycles = []
    for component in _strongly_connected(adjacency):
        members = set(component)
        if len(component) == 1 and component[0] not in adjacency[component[0]]:
            continue
        start = min(component)
        cycles.append(_cycle_through(start, adjacency, members))
    return sorted(cycles)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> Iterator[tuple[int, str, str]]:
    """``(line, imported dotted name, kind)`` for every import in ``tree``."""
    facade = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    stack: list[tuple[ast.AST, str]] = [(n, TOP_LEVEL) for n in tree.body]
    while stack:
        node, kind = stack.pop()
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, kind
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                yield node.lineno, sub if sub in known else base, kind
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value, DYNAMIC
        elif facade and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            yield node.lineno, node.value, DYNAMIC
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, TYPE_ONLY) for child in node.body)
            stack.extend((child, kind) for child in node.orelse)
            continue
        inner = LAZY if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == TOP_LEVEL \
            else kind
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _absolute_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    return named and bool(node.args)


def _strongly_connected(adjacency: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of modules; no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(adjacency):
        if root in index:
            continue
        work = [(root, iter(sorted(adjacency[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adjacency.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def _cycle_through(start: str, adjacency: dict[str, set[str]], members: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(adjacency[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")
