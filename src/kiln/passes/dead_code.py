"""Dead code elimination: drop nodes and weights that no graph output depends on."""

from __future__ import annotations

from ..ir.graph import Graph, reads


def run(graph: Graph) -> None:
    live = {v.name for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):
        if any(o in live for o in node.outputs if o):
            kept.append(node)
            live |= reads(node)
    graph.nodes = kept[::-1]
    graph.initializers = {k: t for k, t in graph.initializers.items() if k in live}
