"""Imports point one way: a lower layer never imports a higher one, no module cycles, plugins import only the
public API, and the public plugin API imports nothing from the entrypoints.

Pure syntax-tree reading (``import_graph``): no tokenmill module, and no torch, is imported here.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.architecture.import_graph import TYPE_ONLY, Edge, ImportGraph, build_graph, discover, find_cycles
from tests.architecture.layers import (
    ALLOWED_BACK_EDGES,
    LAYER_OF,
    LAYERS,
    PUBLIC_PLUGIN_MODULES,
    ROOT_LAYER,
    layer_of,
    rank,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREES = {"framework": "tokenmill", "models": "tokenmill.models", "entrypoints": "tokenmill.entrypoints"}
# In-tree plugins and out-of-tree examples: each folder is one distribution (a source root), with its packages.
PLUGIN_DIRS = {
    "plugins/cpu": {"tokenmill_cpu"},
    "plugins/cuda": {"tokenmill_cuda"},
    "plugins/rocm": {"tokenmill_rocm"},
    "examples/platform_plugin": {"tokenmill_cpuref"},
    "examples/model_plugin": {"layerscale_llama", "make_test_checkpoint"},
}


@cache
def repo_graph() -> ImportGraph:
    trees = {ROOT / folder: package for folder, package in SOURCE_TREES.items()}
    trees.update({ROOT / folder: "" for folder in PLUGIN_DIRS})
    return build_graph(discover(trees))


def _is_tokenmill(module: str) -> bool:
    return module == "tokenmill" or module.startswith("tokenmill.")


def unplaced_modules(graph: ImportGraph) -> list[str]:
    return sorted(m for m in graph.modules if _is_tokenmill(m) and layer_of(m) is None)


def layer_violations(graph: ImportGraph, allowed: dict[tuple[str, str], str]) -> list[str]:
    """Every edge from a lower layer to a higher one that ``allowed`` does not name, one line each."""
    out = []
    for e in graph.edges:
        if not (_is_tokenmill(e.source) and _is_tokenmill(e.target)) or (e.source, e.target) in allowed:
            continue
        low, high = layer_of(e.source), layer_of(e.target)
        if low is not None and high is not None and rank(low) < rank(high):
            out.append(f"{e.where(ROOT)}: {e.source} ({low}) imports {e.target} ({high}) [{e.kind}]")
    return sorted(set(out))


def stale_allowances(graph: ImportGraph, allowed: dict[tuple[str, str], str]) -> list[str]:
    present = {(e.source, e.target) for e in graph.edges}
    return [f"{a} -> {b}" for a, b in allowed if (a, b) not in present]


def cycle_reports(graph: ImportGraph) -> list[str]:
    """Each import cycle (any kind of edge, ``TYPE_CHECKING`` ones included: a type-level cycle is a coupling
    too), written ``a -> b -> a`` with the line of each step."""
    reports = []
    for cycle in find_cycles(graph.adjacency()):
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            edge = min((e for e in graph.edges_from(a) if e.target == b), key=lambda e: e.line)
            steps.append(f"{a} -> {b} ({edge.where(ROOT)}, {edge.kind})")
        reports.append("cycle: " + "; ".join(steps))
    return reports


def plugin_violations(graph: ImportGraph, plugin_dirs: dict[str, set[str]]) -> list[str]:
    """Imports of plugin modules that leave the public API: a non-public tokenmill module, or another plugin's
    package (plugins never import each other)."""
    owner = {pkg: folder for folder, pkgs in plugin_dirs.items() for pkg in pkgs}
    out = []
    for e in graph.edges:
        source_owner = owner.get(e.source.split(".")[0])
        if source_owner is None:
            continue
        # ``imported != target``: a name below a public module that is no module (``import tokenmill.gone``)
        if _is_tokenmill(e.target) and (e.target not in PUBLIC_PLUGIN_MODULES or e.imported != e.target):
            out.append(f"{e.where(ROOT)}: imports {e.imported}, which is not part of tokenmill's public plugin API")
        elif owner.get(e.target.split(".")[0], source_owner) != source_owner:
            out.append(f"{e.where(ROOT)}: imports {e.imported}, another plugin's package")
    return sorted(out)


def reached_from(graph: ImportGraph, start: str) -> dict[str, Edge]:
    """Every module ``start`` loads, directly or through others (any kind of edge), with the edge that first
    reaches it."""
    seen: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        module = frontier.pop()
        for e in graph.edges_from(module):
            if e.target not in seen and e.target != start:
                seen[e.target] = e
                frontier.append(e.target)
    return seen


def entrypoints_reached_from_plugin_api(graph: ImportGraph) -> list[str]:
    return sorted(f"{e.where(ROOT)}: {e.source} imports {target}" for target, e in
                  reached_from(graph, "tokenmill.plugin_api").items()
                  if target.startswith("tokenmill.entrypoints"))


# ---- the repository ----

def test_every_tokenmill_module_has_a_layer() -> None:
    missing = unplaced_modules(repo_graph())
    assert not missing, ("modules in no layer; add their package to LAYER_OF in tests/architecture/layers.py and "
                         "to the table in docs/architecture.md:\n" + "\n".join(missing))


def test_no_import_points_from_a_lower_layer_to_a_higher_one() -> None:
    graph = repo_graph()
    problems = layer_violations(graph, ALLOWED_BACK_EDGES)
    assert not problems, f"back-edges (order: {' -> '.join(LAYERS)}):\n" + "\n".join(problems)
    stale = stale_allowances(graph, ALLOWED_BACK_EDGES)
    assert not stale, "allow-list entries that no import uses any more:\n" + "\n".join(stale)


def test_no_import_cycles() -> None:
    cycles = cycle_reports(repo_graph())
    assert not cycles, "\n".join(cycles)


def test_plugins_and_examples_import_only_the_public_api() -> None:
    graph = repo_graph()
    for folder, packages in PLUGIN_DIRS.items():
        assert any(m.split(".")[0] in packages for m in graph.modules), f"no module found under {folder}"
    problems = plugin_violations(graph, PLUGIN_DIRS)
    assert not problems, "\n".join(problems)


def test_the_public_plugin_api_imports_nothing_from_the_entrypoints() -> None:
    graph = repo_graph()
    assert "tokenmill.plugin_api" in graph.modules
    problems = entrypoints_reached_from_plugin_api(graph)
    assert not problems, "\n".join(problems)


def test_the_docs_list_the_same_layers() -> None:
    """docs/architecture.md's "Layers" table names the same packages per layer as :data:`LAYER_OF`."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, set[str]] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].strip("`*") in LAYERS:
            documented[cells[0].strip("`*")] = set(re.findall(r"`([a-z_.]+)`", cells[1]))
    expected: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for prefix, layer in LAYER_OF.items():
        expected[layer].add(prefix)
    expected[ROOT_LAYER].add("tokenmill")
    assert documented == expected


# ---- the checks catch what they are for ----

def _tree(tmp_path: Path, files: dict[str, str]) -> ImportGraph:
    for rel, source in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    trees = {tmp_path / "framework": "tokenmill", tmp_path / "entrypoints": "tokenmill.entrypoints",
             tmp_path / "plugin": ""}
    return build_graph(discover({folder: pkg for folder, pkg in trees.items() if folder.exists()}))


BASE_TREE = {
    "framework/__init__.py": "",
    "framework/config.py": "",
    "framework/worker/__init__.py": "",
    "framework/worker/model_runner.py": "from tokenmill.config import EngineConfig\n",
    "framework/plugin_api.py": ("import importlib\n_LAZY = {'EngineConfig': 'tokenmill.config'}\n"
                                "def __getattr__(name):\n    return importlib.import_module(_LAZY[name])\n"),
    "entrypoints/__init__.py": "",
    "entrypoints/cli.py": "from tokenmill.worker.model_runner import ModelRunner\n",
    "plugin/chip/__init__.py": "from tokenmill.plugin_api import Platform\n",
}


def test_the_clean_tree_passes(tmp_path: Path) -> None:
    graph = _tree(tmp_path, BASE_TREE)
    assert not layer_violations(graph, {})
    assert not cycle_reports(graph)
    assert not plugin_violations(graph, {"plugin": {"chip"}})
    assert not entrypoints_reached_from_plugin_api(graph)


@pytest.mark.parametrize("statement", [
    "from tokenmill.worker.model_runner import ModelRunner\n",
    "def f():\n    from tokenmill.worker import model_runner\n",
    "import importlib\ndef f():\n    importlib.import_module('tokenmill.entrypoints.cli')\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tokenmill.worker.model_runner\n",
])
def test_a_back_edge_fails(tmp_path: Path, statement: str) -> None:
    graph = _tree(tmp_path, {**BASE_TREE, "framework/config.py": statement})
    problems = layer_violations(graph, {})
    assert len(problems) == 1 and "tokenmill.config (foundation) imports" in problems[0], problems
    assert str(tmp_path / "framework/config.py") in problems[0]
    target = problems[0].split(" imports ")[1].split(" ")[0]
    assert not layer_violations(graph, {("tokenmill.config", target): "a deliberate exception"})


def test_an_unplaced_module_fails(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {**BASE_TREE, "framework/newthing/__init__.py": ""})
    assert unplaced_modules(graph) == ["tokenmill.newthing"]


def test_a_cycle_fails_even_when_hidden_in_a_function(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {**BASE_TREE, "framework/worker/compiled_runner.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenmill.worker.model_runner import X\n"),
        "framework/worker/model_runner.py": "def f():\n    from tokenmill.worker import compiled_runner\n"})
    (report,) = cycle_reports(graph)
    assert report.startswith("cycle: tokenmill.worker.compiled_runner -> tokenmill.worker.model_runner")
    assert f"-> tokenmill.worker.compiled_runner ({tmp_path / 'framework/worker/model_runner.py'}:2, lazy)" in report
    assert TYPE_ONLY in report


def test_a_plugin_importing_a_private_module_or_another_plugin_fails(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {**BASE_TREE, "plugin/chip/runner.py": (
        "from tokenmill.plugin_api import Platform\n"
        "from tokenmill.worker.model_runner import ModelRunner\n"
        "from tokenmill import worker\n"
        "import tokenmill.worker.gone\n"
        "import tokenmill.gone\n"
        "from tokenmill import LLM\n"
        "def f():\n    from otherchip import kernels\n"),
        "plugin/otherchip/__init__.py": "", "plugin/otherchip/kernels.py": ""})
    problems = plugin_violations(graph, {"plugin": {"chip"}, "other": {"otherchip"}})
    lines = sorted(int(p.split(":")[1]) for p in problems)
    assert lines == [2, 3, 4, 5, 8], problems
    assert sum("another plugin's package" in p for p in problems) == 1


def test_plugin_api_reaching_the_entrypoints_fails(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {**BASE_TREE, "framework/plugin_api.py": (
        "import importlib\n_LAZY = {'ModelRunner': 'tokenmill.worker.model_runner', "
        "'ToolParser': 'tokenmill.entrypoints.cli'}\n"
        "def __getattr__(name):\n    return importlib.import_module(_LAZY[name])\n")})
    (problem,) = entrypoints_reached_from_plugin_api(graph)
    assert "tokenmill.plugin_api imports tokenmill.entrypoints.cli" in problem
