"""The package's import layering, read from the source with ``ast`` (every import, lazy ones inside
functions included, relative ones resolved).

Why a test: a newcomer reads the package bottom-up, and a layer that imports one above it (or two that
import each other) means neither can be understood, tested or moved alone. ``LAYERS`` is the one order;
every import of one top-level package/module of ``mars_megatron`` by another must go *down* it, which also
rules out circles (checked on its own too, so a circle is reported as a circle). Modules inside a layer
may not import each other either. HF ↔ Megatron conversion is part of the package (``conversion``,
``convert``), so no second top-level package can import it and be imported back.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mars_megatron"

LAYERS: tuple[str, ...] = (
    "lazy_jit",  # the import hook that defers megatron-core's torch.compile decorations: installed by...
    "",  # ...the package's own __init__, which runs before any of its modules, so it sits just above
    # leaves: no package imports, used everywhere
    "deadline",  # waits that say what they waited for (DeadlineError)
    "reaper",  # a replaced worker's process ended for sure (SIGKILL on its node)
    "json_file",
    "yaml_file",  # configs and graph files: duplicate keys, alias bombs, UTF-16 refused
    "row_filter",  # data.filter's conditions: the config checks them, the data loader applies them
    "metrics",
    "runtime_env",  # the numerics and thread pins every process takes before torch runs
    "seeds",  # seeds derived from names (blake2b), for every random choice of a run
    # settings (torch-free, so a login node can check a config and plan a layout), torch's names for them,
    # then what a model is (architecture from config.json, presets, layout, tokenizer)
    "config",
    "config_reference",  # the config tree as markdown (docs/config.md)
    "dtypes",
    "models",
    # the multi-agent protocol, then pure maths on it, then rewards of it
    "agents",
    "algorithm",
    "rewards",
    "problems",  # a task's problems from its data files (JSONL, Parquet, datasets folders), mapped
    "checkpoint",
    # torch.distributed plumbing (collectives' device rule, the one-address store), then weight transfer
    "comm",
    "transfer",
    # HF ↔ Megatron weights (mapping, safetensors I/O, the export the weight push walks), then the trainer,
    # then building a model to read or write its dist checkpoint (`mars convert`)
    "conversion",
    "training",
    "convert",
    # one job on a trainer rank (build engine, train steps): used by rl's workers and tasks' SFT
    "jobs",
    "rollout",
    "evaluation",
    "rl",
    "pipeline",
    "tasks",
    "launch",
    "cli",
)
"""Bottom to top: a layer may import only layers before it."""


@dataclass(frozen=True)
class Edge:
    """One import of ``target`` (a dotted module) by ``source`` at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int

    def layers(self, package: str) -> tuple[str, str]:
        return layer_of(self.source, package), layer_of(self.target, package)

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def layer_of(module: str, package: str) -> str:
    """``mars_megatron.training.fp8`` → ``training``; the package itself → ``""``."""
    parts = module.split(".")
    assert parts[0] == package, module
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """Dotted name of the file ``path`` under ``root`` (the package's parent), and whether it is a package
    ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_init = parts[-1] == "__init__"
    if is_init:
        parts = parts[:-1]
    return ".".join(parts), is_init


def imports(root: Path, package: str) -> list[Edge]:
    """Every import of a ``package`` module by a ``package`` module, anywhere in the file's syntax tree."""
    edges = []
    for path in sorted((root / package).rglob("*.py")):
        source, is_init = module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    # a package's __init__ is its own package; a module's package is its parent
                    base = source.split(".") if is_init else source.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # ``from pkg import mod`` imports the submodule when there is one
                targets = [
                    f"{module}.{alias.name}" if _is_module(root, f"{module}.{alias.name}") else module
                    for alias in node.names
                ]
            for target in targets:
                if target == package or target.startswith(package + "."):
                    edges.append(Edge(source, target, rel, node.lineno))
    return edges


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward(edges: list[Edge], layers: tuple[str, ...], package: str) -> list[str]:
    """Imports that do not go down ``layers`` (or involve a layer missing from it), as messages."""
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for edge in edges:
        low, high = edge.layers(package)
        if low == high:
            continue
        if low not in rank or high not in rank:
            missing = low if low not in rank else high
            bad.append(f"{edge.where()} (layer {missing!r} is not in LAYERS)")
        elif rank[high] > rank[low]:
            bad.append(f"{edge.where()} (upward: {low} is below {high})")
    return bad


def cycles(edges: list[Edge], package: str, *, modules: bool = False) -> list[str]:
    """Circles between top-level layers, or with ``modules`` between modules (inside one layer too),
    found as Tarjan's strongly connected components, each with one import per step so the message shows
    where to cut."""
    graph: dict[str, dict[str, Edge]] = defaultdict(dict)
    for edge in edges:
        low, high = (edge.source, edge.target) if modules else edge.layers(package)
        if low != high:
            graph[low].setdefault(high, edge)
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                lowlink[node] = min(lowlink[node], lowlink[succ])
            elif succ in stack:
                lowlink[node] = min(lowlink[node], index[succ])
        if lowlink[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    messages = []
    for component in components:
        inside = [graph[a][b].where() for a in component for b in sorted(graph[a]) if b in component]
        messages.append(f"circle between {', '.join(component)}:\n    " + "\n    ".join(inside))
    return messages


EDGES = imports(REPO, PACKAGE)


def test_every_layer_is_listed():
    root = REPO / PACKAGE
    found = {p.stem for p in root.glob("*.py")} | {
        p.name for p in root.iterdir() if (p / "__init__.py").is_file()
    }
    found = (found - {"__init__"}) | {""}  # the package's __init__ is the layer ""
    assert sorted(found - set(LAYERS)) == [], "add these to LAYERS"
    assert sorted(set(LAYERS) - found) == [], "no such layer any more"


def test_no_import_circles():
    found = cycles(EDGES, PACKAGE)
    assert found == [], "\n".join(found)


def test_no_module_imports_another_that_imports_it_back():
    """Inside a layer too: two modules that import each other (even lazily, or for annotations only)
    can be read only together; one of them holds what both need."""
    found = cycles(EDGES, PACKAGE, modules=True)
    assert found == [], "\n".join(found)


def test_imports_go_down():
    found = upward(EDGES, LAYERS, PACKAGE)
    assert found == [], "\n".join(found)


def test_lazy_and_relative_imports_are_seen():
    """Relative imports resolve, and an import inside a function counts like one at the top."""
    pairs = {(edge.source, edge.target) for edge in EDGES}
    assert ("mars_megatron.metrics.sink", "mars_megatron.metrics.plot") in pairs  # inside a method


# --- the checker can fail -------------------------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A package ``pkg`` of three layers: ``low`` imports ``high`` lazily and relatively; ``high`` imports
    ``low`` at the top; ``mid`` stays clean."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from .core import thing\n")
    (pkg / "low" / "core.py").write_text("def thing():\n    from ..high import top\n    return top\n")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "high" / "top.py").write_text("from pkg.low.core import thing\nfrom pkg import mid\n")
    (pkg / "mid.py").write_text("import os\n")
    return tmp_path


def test_checker_finds_a_planted_circle(planted: Path):
    edges = imports(planted, "pkg")
    found = cycles(edges, "pkg")
    assert len(found) == 1
    assert "circle between high, low" in found[0]
    assert "pkg/low/core.py:2: pkg.low.core imports pkg.high.top" in found[0]
    assert "pkg/high/top.py:1: pkg.high.top imports pkg.low.core" in found[0]
    found = cycles(edges, "pkg", modules=True)
    assert len(found) == 1 and "circle between pkg.high.top, pkg.low.core" in found[0]


def test_checker_finds_a_planted_upward_import(planted: Path):
    edges = imports(planted, "pkg")
    found = upward(edges, ("low", "mid", "high"), "pkg")
    assert found == ["pkg/low/core.py:2: pkg.low.core imports pkg.high.top (upward: low is below high)"]
    found = upward(edges, ("low", "high"), "pkg")
    assert "pkg/high/top.py:2: pkg.high.top imports pkg.mid (layer 'mid' is not in LAYERS)" in found
