"""A kiln Graph as text: one line per node, for reading a graph where ONNX cannot hold it.

    graph NAME
      input x: float32[N, 3, 224, 224]
      weight conv.weight: float32[64, 3, 7, 7]
      conv1: y = kiln::FusedConv(x, conv.weight, conv.bias) {activation: 'Relu', ...}  [float16, device, tactic]
      output y: float16[N, 64, 112, 112]
Subgraphs (If/Loop/Scan bodies) follow their node, indented.
"""

from __future__ import annotations

import torch

from .graph import Graph, Node, Value


def _dims(shape) -> str:
    return "?" if shape is None else "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _value(v: Value) -> str:
    text = f"{str(v.dtype).removeprefix('torch.') if v.dtype is not None else '?'}{_dims(v.shape)}"
    text = f"sequence({text})" if v.sequence else text
    return f"{v.name}: optional({text})" if v.optional else f"{v.name}: {text}"


def _attr(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph)):
        return "<subgraph>"
    if hasattr(v, "WhichOneof"):  # an ONNX TypeProto (Optional's type)
        return f"<{v.WhichOneof('value')}>"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _node(n: Node) -> str:
    op = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
    attrs = ", ".join(f"{k}: {_attr(v)}" for k, v in sorted(n.attrs.items()))
    return (f"{n.name or '-'}: {', '.join(n.outputs)} = {op}({', '.join(n.inputs)})" + (f" {{{attrs}}}" if attrs else "")
            + f"  [{n.precision}, {n.placement}, {n.tactic}]" + (f"  # {n.note}" if n.note else ""))


def graph_text(graph: Graph, indent: str = "") -> str:
    lines = [f"{indent}graph {graph.name}"]
    lines += [f"{indent}  input {_value(v)}" for v in graph.inputs]
    lines += [f"{indent}  weight {k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
              for k, t in graph.initializers.items()]
    for n in graph.nodes:
        lines.append(f"{indent}  {_node(n)}")
        for v in n.attrs.values():
            for g in v if isinstance(v, list) else [v]:
                if isinstance(g, Graph):
                    lines.append(graph_text(g, indent + "    ").rstrip("\n"))
    lines += [f"{indent}  output {_value(v)}" for v in graph.outputs]
    return "\n".join(lines) + "\n"
