"""Layer precision: which compute precision each layer runs in.

FP16/BF16 builds run every layer in the requested precision except ops whose
registry entry says why they must stay FP32 (e.g. large sums overflow FP16);
those stay FP32 and the engine records the reason. Shape arithmetic (host
nodes) always keeps its original types. Weights used only by low-precision
layers are stored in that precision.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from ..ops.registry import lookup

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
INT8_LAYERS = ("QGemm", "QConv")  # int8 math with float epilogues, whatever the build's float precision


def _set_body(node, precision: str) -> None:
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if isinstance(g, Graph):
                for sub in g.walk():
                    sub.precision = precision


def assign(graph: Graph, precision: str) -> None:
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        if node.placement == "host":
            node.precision = "float32"
        elif node.domain == "kiln" and node.op_type in INT8_LAYERS:
            node.precision = node.attr("qtype", "int8")
        elif precision in _LOW and entry.keep_fp32:
            node.precision, node.note = "float32", f"kept FP32: {entry.keep_fp32}"
        else:
            node.precision = precision
        _set_body(node, node.precision)
    _cast_weights(graph)


def _cast_weights(graph: Graph) -> None:
    uses: dict[str, set] = {}
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        for pos, name in enumerate(node.inputs):
            if name in graph.initializers:
                keep = node.placement == "host" or entry.keeps_input_types or pos in entry.host_inputs
                uses.setdefault(name, set()).add(None if keep else node.precision)
    outputs = {v.name for v in graph.outputs}
    for name, precs in uses.items():
        w = graph.initializers[name]
        if len(precs) == 1 and (p := next(iter(precs))) in _LOW and w.dtype == torch.float32 and name not in outputs:
            graph.initializers[name] = w.to(_LOW[p])
