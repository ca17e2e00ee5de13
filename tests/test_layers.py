"""Kiln's packages form layers: each imports only the layers below it, never one above, and no two import
each other. Every import counts, those inside functions too (an import deferred into a function is still a
dependency; it only hides the cycle until that function runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

SRC = Path(kiln.__file__).parent

# Bottom to top. A package (or top-level module) may import its own layer's peers and anything below.
LAYERS = [
    ("errors", "fileio", "json_file", "console", "progress", "version"),  # user errors, files, terminal output
    ("ir",),  # the graph
    ("ops",),  # what each operator computes: shape rules and torch reference implementations
    ("kernels",),  # Triton and library kernels, each checked against its op's reference
    ("tactics",),  # candidate implementations of a layer (the runtime runs the chosen ones)
    ("engine", "samples"),  # the runtime: interpreter, execution context, streams, the engine file; input samples
    ("frontend",),  # ONNX loading and checking, PyTorch export
    ("passes",),  # the graph rewrites, in the order they run
    ("builder",),  # one build: the pass list, placement, precision, layout, tactic timing -> Engine
    ("quant",),  # calibration (of an FP32 engine), Q/DQ export, INT4, QAT, the precision search's steps
    ("llm",),  # the decoding engine
    ("tools",),  # inspect, compare, verify, bench, report
    ("build",),  # kiln.build: calibration, precision search and keep-faster-float around the builder
    ("serve",),
    ("compile", "dynamo", "backend", "models", "examples"),  # kiln.compile, torch.compile's backend, ONNX backend
    ("cli", "cli_flags", "__main__"),
    ("",),  # the kiln package itself (src/kiln/__init__.py): the public API
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


MODULES = {_module(p)[0]: p for p in SRC.rglob("*.py")}


def _unit(module: str) -> str:
    """The layer unit a kiln module belongs to: its package under kiln ('' for kiln itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, here: str | None = None, package: bool = False) -> list[tuple[str, int]]:
    """(kiln module imported, line) for every import in the file, at any depth. `here`: the file's module name
    (by default, from its place under src/kiln)."""
    if here is None:
        here, package = _module(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if package else here.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from kiln.x import y` imports module kiln.x.y where that is one, else reads a name of kiln.x
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t == "kiln" or t.startswith("kiln."):
                found.append((t, node.lineno))
    return found


def test_every_import_of_kiln_names_a_module_that_exists():
    missing = [f"{path.relative_to(SRC.parent)}:{line} imports {t}" for path in MODULES.values()
               for t, line in _imports(path) if t not in MODULES]
    assert missing == []


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where, for imports between different units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in MODULES.items():
        for target, line in _imports(path):
            a, b = _unit(module), _unit(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{path.relative_to(SRC.parent)}:{line} imports {target}")
    return edges


def test_every_package_has_a_layer():
    assert sorted({_unit(m) for m in MODULES} - set(RANK)) == []


def test_no_package_imports_a_layer_above_it():
    upward = [w for (a, b), where in _edges().items() if RANK[b] > RANK[a] for w in where]
    assert upward == []


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in _edges():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            n = todo.pop()
            if n == goal:
                return True
            if n not in seen:
                seen.add(n)
                todo.extend(graph.get(n, ()))
        return False

    cycles = sorted({tuple(sorted((a, b))) for a, bs in graph.items() for b in bs if reaches(b, a)})
    assert cycles == []


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..ir.graph import Graph\n\n\ndef f():\n    from ..tools import compare\n"
                     "    import kiln.builder.builder\n    from . import serialize\n")
    assert _imports(probe, "kiln.engine.probe") == [("kiln.ir.graph", 1), ("kiln.tools.compare", 5),
                                                    ("kiln.builder.builder", 6), ("kiln.engine.serialize", 7)]
