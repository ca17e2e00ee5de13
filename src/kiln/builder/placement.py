"""Host/device placement: which nodes are shape arithmetic.

A value is host-known when it is a weight, the output of a shape-only op (Shape,
Size), or computed only from host-known values. Such values are constant for a
given input shape, so the runtime computes them on the CPU once per shape and
the device work alone is captured in the CUDA graph (TensorRT calls these
shape tensors).
"""

from __future__ import annotations

from ..ir.graph import Graph
from ..ops.registry import lookup


def assign(graph: Graph) -> bool:
    """Mark each node host or device; return True when the device work can be
    captured as one CUDA graph (no value-dependent shapes, no control flow)."""
    host_known = set(graph.initializers)
    capturable = True
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        ins = [i for i in node.inputs if i]
        pure = not (entry.nondeterministic or entry.uses_scope or entry.data_dependent)
        if entry.shape_only or (pure and ins and all(i in host_known for i in ins)):
            node.placement = "host"
            host_known.update(o for o in node.outputs if o)
            continue
        node.placement = "device"
        if entry.data_dependent or entry.uses_scope or entry.nondeterministic:
            capturable = False  # random ops would replay the same numbers
        for pos in entry.host_inputs:
            if pos < len(node.inputs) and node.inputs[pos] and node.inputs[pos] not in host_known:
                capturable = False  # a shape argument computed from data
    return capturable


def inputs_read_as_values(graph: Graph) -> list[str]:
    """The graph inputs some layer reads as numbers (a Range delta, a Slice end): random values cannot stand in
    for them, so a build runs no validation or tactic timing on random data."""
    names = {v.name for v in graph.inputs}
    found = set()
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        for pos in entry.host_inputs:
            if pos < len(node.inputs) and node.inputs[pos] in names:
                found.add(node.inputs[pos])
    return sorted(found)
