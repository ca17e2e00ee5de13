"""GatherND whose index tuples are shape arithmetic -> kiln::GatherNDOffsets (host) + kiln::GatherNDRows.

HF transformers builds BERT's padding mask as a GatherND of the attention mask over arange-made indices.
The indices depend only on the input shape, yet GatherND turned them into offsets on the device in every
run: seven small int64 kernels at batch 1. Split, the offsets are computed on the host once per input
shape (builder/placement.py places GatherNDOffsets there, its inputs being host values) and the device
runs one gather."""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import host_values, replace


def run(graph: Graph) -> None:
    host = host_values(graph)
    for node in [n for n in graph.nodes if n.op_type == "GatherND" and not n.domain]:
        data, indices = node.inputs[0], node.inputs[1]
        if node.attr("batch_dims", 0) != 0 or indices not in host or data in host:
            continue  # data-dependent indices stay as they are; all-host GatherND is host work already
        out = node.outputs[0]
        shape = Node("Shape", [data], [f"{out}.data_shape"], name=f"{node.name}.data_shape")
        offsets = Node("GatherNDOffsets", [indices, shape.outputs[0]], [f"{out}.offsets"],
                       name=f"{node.name}.offsets", domain="kiln")
        gather = Node("GatherNDRows", [data, offsets.outputs[0], indices], [out], name=node.name, domain="kiln")
        replace(graph, [node], gather)
        at = next(i for i, n in enumerate(graph.nodes) if n is gather)
        for n in (shape, offsets):
            n.opset, n.sources = node.opset, [node.name]
        graph.nodes[at:at] = [shape, offsets]
