"""The graph optimization pipeline, in the order it runs.

Each pass is one module with `run(graph) -> None` (it rewrites the graph in
place) and one test: graph before/after, numerics unchanged.
"""

from . import dead_code, fold_constants

PIPELINE = [
    fold_constants,  # Constant nodes and constant-only subgraphs become weights
    dead_code,  # nodes nothing reads, weights nothing uses
]


def optimize(graph, on_pass=None) -> None:
    for p in PIPELINE:
        p.run(graph)
        if on_pass:
            on_pass(p.__name__.rsplit(".", 1)[-1])
