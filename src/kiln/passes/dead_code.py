"""Dead code elimination: drop nodes and weights that no graph output depends on."""

from __future__ import annotations

from ..ir.graph import Graph


def reads(node) -> set[str]:
    """Names a node reads, including outer-scope names read inside its subgraphs."""
    names = {i for i in node.inputs if i}
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if hasattr(g, "walk"):
                for sub in g.walk():
                    names.update(i for i in sub.inputs if i)
    return names


def run(graph: Graph) -> None:
    live = {v.name for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):
        if any(o in live for o in node.outputs if o):
            kept.append(node)
            live |= reads(node)
    graph.nodes = kept[::-1]
    graph.initializers = {k: t for k, t in graph.initializers.items() if k in live}
