"""Chains of elementwise ops -> one kiln::Elementwise layer (a generated Triton kernel on GPU).

A region grows backwards from an elementwise node through producers that are
elementwise too and read by nothing else; scalar weights become inline
constants, and an op's attributes (HardSigmoid's alpha and beta, Clip's bounds,
Pow's exponent) literal constants of its program line. One kernel reads each
input once and writes one output, instead of one launch and one intermediate
tensor per op.

A binary op alone between two computed activations becomes a one-line layer too:
those are where broadcasts and strided views meet (a squeeze-excite scale times a
channels-last activation, a residual added to a channel slice of a Split), which
torch runs through its generic strided kernel, one scalar load per element; the
generated kernel reads them vectorized, and the build's tactic timing keeps torch
(the layer's reference) where it is as fast. A lone op on a model input or a
weight stays as it is.

Not fused: Cast (a program computes in FP32 and writes its inputs' float type),
comparisons and logic (bool values), Pow with a tensor exponent, Clip with tensor
bounds, Gelu of an unknown approximation.
"""

from __future__ import annotations

import math

from ..ir.graph import Graph, Node
from ..ops.fused import ATTRIBUTE_ARGS, BINARY, UNARY
from .rewrite import View, fused_name, host_values, replace

FUSABLE = UNARY | BINARY | {"Clip", "Where"}
_DEFAULTS = {"HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.01,), "Elu": (1.0,)}  # ONNX's attribute defaults
_SINGLE = {"Add", "Sub", "Mul", "Div", "Max", "Min"}


def _line(view: View, n: Node | None) -> tuple[str, list[str], list[float]] | None:
    """(program op, tensor operands, literal operands) of a node a program can compute, else None."""
    # Before opset 7, binary ops broadcast by attribute, which a program does not carry.
    if n is None or n.domain or n.op_type not in FUSABLE or len(n.outputs) != 1 or n.opset < 7:
        return None
    op, ins = n.op_type, list(n.inputs)
    if op in ATTRIBUTE_ARGS:
        return (op, ins, [float(n.attr(k, d)) for k, d in zip(ATTRIBUTE_ARGS[op], _DEFAULTS[op])]) \
            if len(ins) == 1 else None
    if op == "Gelu":
        kind = n.attr("approximate", "none")
        return ({"none": "Gelu", "tanh": "GeluTanh"}[kind], ins, []) if kind in ("none", "tanh") else None
    if op == "Pow":
        e = view.const(ins[1]) if len(ins) == 2 else None
        return (op, ins[:1], [float(e)]) if e is not None and e.dim() == 0 else None
    if op == "Clip":
        return _clip(view, n)
    if op == "Where":
        # the condition stays an input (bool); two constant values would leave no float input to type the program
        both_constant = all(view.const(i) is not None for i in ins[1:])
        return (op, ins, []) if len(ins) == 3 and all(ins) and not both_constant else None
    if any(not i for i in ins):
        return None
    return (op, ins, []) if len(ins) == (1 if op in UNARY else 2) else None


def _clip(view: View, n: Node):
    if n.opset < 11:
        return "Clip", n.inputs[:1], [float(n.attr("min", -math.inf)), float(n.attr("max", math.inf))]
    bounds = []
    for pos, missing in ((1, -math.inf), (2, math.inf)):
        name = n.inputs[pos] if len(n.inputs) > pos else ""
        if not name:
            bounds.append(missing)
        elif (c := view.const(name)) is not None and c.numel() == 1 and c.dtype.is_floating_point:
            bounds.append(float(c.reshape(-1)[0]))
        else:
            return None  # a tensor bound, or an integer Clip
    return "Clip", n.inputs[:1], bounds


def _region(view: View, root: Node) -> list[Node]:
    region, stack = [root], [root]
    while stack:
        n = stack.pop()
        operands = _line(view, n)[1]
        for i in operands:
            p = view.producer.get(i)
            if _line(view, p) is not None and p not in region and view.sole_reader(i) is n:
                region.append(p)
                stack.append(p)
    order = {id(n): k for k, n in enumerate(view.graph.nodes)}
    return sorted(region, key=lambda n: order[id(n)])


def _program(view: View, region: list[Node]):
    inputs: list[str] = []
    temps: dict[str, str] = {}
    lines = []
    for n in region:
        op, operands, literals = _line(view, n)
        args = []
        for pos, i in enumerate(operands):
            if i in temps:
                args.append(temps[i])
            elif not (op == "Where" and pos == 0) and (c := view.scalar(i)) is not None and view.const(i).dim() == 0:
                args.append(f"c{c!r}")
            else:
                if i not in inputs:
                    inputs.append(i)
                args.append(f"i{inputs.index(i)}")
        temps[n.outputs[0]] = f"t{len(temps)}"
        lines.append(" ".join([op, temps[n.outputs[0]], *args, *(f"c{v!r}" for v in literals)]))
    return inputs, lines


def _worth_alone(view: View, n: Node, host: set[str]) -> bool:
    """A binary op between two activations: values device layers compute, not weights, model inputs or shape
    arithmetic."""
    return n.op_type in _SINGLE and len(n.inputs) == 2 and n.inputs[0] != n.inputs[1] \
        and all(i in view.producer and i not in host for i in n.inputs)


def run(graph: Graph) -> None:
    view = View(graph)
    host = host_values(graph)  # shape arithmetic stays as it is: it runs on the host
    done: set[int] = set()
    for root in reversed(list(graph.nodes)):
        if id(root) in done or _line(view, root) is None or root.outputs[0] in host:
            continue
        reader = view.sole_reader(root.outputs[0])
        if _line(view, reader) is not None and root.outputs[0] in _line(view, reader)[1]:
            continue  # not the end of a chain: it will be fused from its reader
        region = _region(view, root)
        done.update(id(n) for n in region)
        if len(region) < 2 and not _worth_alone(view, root, host):
            continue
        inputs, lines = _program(view, region)
        fused = Node("Elementwise", inputs, [root.outputs[0]], {"program": lines}, name=fused_name(region),
                     domain="kiln")
        replace(graph, region, fused)
        view.refresh()
