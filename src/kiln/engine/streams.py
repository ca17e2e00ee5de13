"""Auxiliary streams: heavy layers that run beside the main chain inside the CUDA graph.

At batch 1 a ResNet convolution fills a fraction of the GPU, so a branch such as a
stage's downsample convolution (it reads the block input and only the block's last
convolution reads it) can run while the main chain computes conv1 and conv2. The
engine's layer list is one topological order; this module finds layers that may
run on an auxiliary stream: a heavy layer whose outputs have one reader, with
another heavy layer between its inputs' producers and that reader (work to overlap).
In the captured graph such a layer waits only for the producers of its inputs and
its reader waits for it, so the two chains become parallel branches of the graph
(TensorRT's auxiliary streams, trtexec --maxAuxStreams; off by default, see BuildConfig).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph

# Layers worth a stream of their own: GEMMs, convolutions, attention. Views and elementwise
# kernels are too short for the overlap to pay for the extra dependency edges.
HEAVY = {"Conv", "FusedConv", "QConv", "MatMul", "Gemm", "FusedGemm", "QGemm", "GemmSkipLayerNorm", "Attention",
         "Int4Gemm"}


@dataclass(frozen=True)
class Branch:
    join: int  # its outputs' only reader, which waits for it on the main stream
    after: tuple[str, ...]  # values it reads that device layers on the main stream produce


def plan(graph: Graph) -> dict[int, Branch]:
    """Layer index -> Branch for every layer that can run on the auxiliary stream."""
    nodes = graph.nodes
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs if o}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in dict.fromkeys(x for x in n.inputs if x):
            readers.setdefault(name, []).append(i)
    outputs = {v.name for v in graph.outputs}
    heavy_at = [i for i, n in enumerate(nodes) if n.placement == "device" and n.op_type in HEAVY]

    # Per heavy layer: the values it reads that device layers produce, and the last of those producers.
    after_of = {i: tuple(x for x in dict.fromkeys(nodes[i].inputs) if x and x in producer
                         and nodes[producer[x]].placement == "device") for i in heavy_at}
    ready_at = {i: max((producer[x] for x in after_of[i]), default=-1) for i in heavy_at}

    branches: dict[int, Branch] = {}
    # Earliest-ready first: of ResNet's conv2 (reads conv1) and the downsample beside it (reads the block
    # input), the downsample is the one off the chain.
    for i in sorted(heavy_at, key=lambda i: (ready_at[i], i)):
        outs = [o for o in nodes[i].outputs if o]
        joins = {j for o in outs for j in readers.get(o, [])}
        if len(joins) != 1 or any(o in outputs for o in outs):
            continue
        join, after, start = joins.pop(), after_of[i], ready_at[i]
        if any(producer[x] in branches for x in after):
            continue  # one layer per branch: it reads main-stream values only
        if any(start < k < join and k != i and k not in branches for k in heavy_at):  # main-stream work to overlap
            branches[i] = Branch(join, after)
    return branches
