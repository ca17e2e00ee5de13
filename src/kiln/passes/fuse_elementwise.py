"""Chains of elementwise ops -> one kiln::Elementwise layer (a generated Triton kernel on GPU).

A region grows backwards from an elementwise node through producers that are
elementwise too and read by nothing else; scalar weights become inline
constants. One kernel reads each input once and writes one output, instead of
one launch and one intermediate tensor per op.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from ..ops.fused import BINARY, UNARY
from .rewrite import View, fused_name, host_values, replace

FUSABLE = UNARY | BINARY


def _fusable(n: Node | None) -> bool:
    # Before opset 7, binary ops broadcast by attribute, which a program does not carry.
    return n is not None and not n.domain and n.op_type in FUSABLE and len(n.outputs) == 1 \
        and len(n.inputs) == (1 if n.op_type in UNARY else 2) and n.opset >= 7


def _region(view: View, root: Node) -> list[Node]:
    region, stack = [root], [root]
    while stack:
        n = stack.pop()
        for i in n.inputs:
            p = view.producer.get(i)
            if _fusable(p) and p not in region and view.sole_reader(i) is n:
                region.append(p)
                stack.append(p)
    order = {id(n): k for k, n in enumerate(view.graph.nodes)}
    return sorted(region, key=lambda n: order[id(n)])


def _program(view: View, region: list[Node]):
    inputs: list[str] = []
    temps: dict[str, str] = {}
    lines = []
    for n in region:
        args = []
        for i in n.inputs:
            if i in temps:
                args.append(temps[i])
            elif (c := view.scalar(i)) is not None and view.const(i).dim() == 0:
                args.append(f"c{c!r}")
            else:
                if i not in inputs:
                    inputs.append(i)
                args.append(f"i{inputs.index(i)}")
        temps[n.outputs[0]] = f"t{len(temps)}"
        lines.append(" ".join([n.op_type, temps[n.outputs[0]], *args]))
    return inputs, lines


def run(graph: Graph) -> None:
    view = View(graph)
    host = host_values(graph)  # shape arithmetic stays as it is: it runs on the host
    done: set[int] = set()
    for root in reversed(list(graph.nodes)):
        if id(root) in done or not _fusable(root) or root.outputs[0] in host:
            continue
        reader = view.sole_reader(root.outputs[0])
        if _fusable(reader):
            continue  # not the end of a chain: it will be fused from its reader
        region = _region(view, root)
        done.update(id(n) for n in region)
        if len(region) < 2:
            continue
        inputs, lines = _program(view, region)
        fused = Node("Elementwise", inputs, [root.outputs[0]], {"program": lines}, name=fused_name(region),
                     domain="kiln")
        replace(graph, region, fused)
        view.refresh()
