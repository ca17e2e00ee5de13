"""Constant folding: evaluate, once at build time, every node whose inputs are all weights."""

from __future__ import annotations

import torch

from ..engine.interpreter import call_node
from ..ir.graph import Graph, Node
from ..ops.registry import lookup
from ..ops.shape import constant_value

# Folding must not turn a small graph into a huge file (e.g. ConstantOfShape of a big shape).
MAX_FOLDED_ELEMENTS = 1 << 24


def _quantized_weight(node: Node, consts: dict) -> bool:
    """DequantizeLinear of 8-bit (or narrower) weights, integer or FP8: kept so fuse_qdq can run the layer on the
    codes. (torch counts float8_e4m3fn as floating point: it is told apart by its one-byte size.)"""
    if node.op_type != "DequantizeLinear" or node.domain:
        return False
    w = consts.get(node.inputs[0])
    return w is not None and (not w.dtype.is_floating_point or w.dtype.itemsize == 1)


def _foldable(node: Node, consts: dict, keep_quantized: bool) -> bool:
    entry = lookup(node.op_type, node.domain)
    if entry is None or entry.nondeterministic or entry.uses_scope:
        return False
    if keep_quantized and _quantized_weight(node, consts):
        return False
    if entry.shape_only:  # Shape of a weight is known; Shape of an activation is not
        return all(i in consts for i in node.inputs if i)
    return bool(node.inputs) and all(i in consts for i in node.inputs if i)


def run(graph: Graph, keep_quantized: bool = True) -> None:
    consts = graph.initializers
    kept = []
    for node in graph.nodes:
        if node.op_type == "Constant" and node.domain == "":
            consts[node.outputs[0]] = constant_value(node)
            continue
        if _foldable(node, consts, keep_quantized):
            outs = call_node(node, [consts[i] if i else None for i in node.inputs])
            if all(isinstance(t, torch.Tensor) and t.numel() <= MAX_FOLDED_ELEMENTS for t in outs):
                for name, t in zip(node.outputs, outs):
                    if name:
                        consts[name] = t
                continue
        kept.append(node)
    graph.nodes = kept
