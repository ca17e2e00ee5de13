"""Conv + bias + residual Add + activation -> one kiln::FusedConv layer.

ResNet's bottleneck ends in conv -> (folded BN) -> Add(shortcut) -> Relu: one
layer, one cuDNN call (cudnn_convolution_add_relu) instead of three kernels.
A fused convolution always carries a bias (zeros when the model has none): torch's
fused cuDNN calls otherwise allocate and zero one on every call, a fill kernel per
layer that a kernel trace of ResNet-50 at batch 1 (bench/trace.py) showed as 14% of the run.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from . import activations
from .rewrite import View, fused_name, miss, replace


def run(graph: Graph) -> None:
    view = View(graph)
    for conv in [n for n in graph.nodes if n.op_type == "Conv" and n.domain == ""]:
        out = conv.outputs[0]
        group, residual = [conv], None
        add = view.sole_reader(out)
        if add is not None and add.op_type == "Add" and add.domain == "":
            other = view.other_input(add, out)
            if other and other != out and view.const(other) is None:  # a tensor shortcut, not a bias
                group.append(add)
                residual, out = other, add.outputs[0]
        act = activations.match(view, out)
        if act is not None:
            group += act.nodes
            out = act.output
        elif len(view.consumers.get(out, [])) > 1 and any(
                u.op_type in ("Relu", "Sigmoid", "Clip", "LeakyRelu") for u in view.consumers[out]):
            miss(graph, "Conv + activation", group, f"output {out} has {view.readers(out)} readers")
        if len(group) == 1:
            continue
        inputs = list(conv.inputs) + [""] * (3 - len(conv.inputs))
        w = view.const(inputs[1])
        if not inputs[2] and w is not None:
            inputs[2] = f"{conv.name}.zero_bias"
            graph.initializers[inputs[2]] = torch.zeros(w.shape[0], dtype=w.dtype)
        if residual:
            inputs.append(residual)
        attrs = dict(conv.attrs, activation=act.name if act else "", activation_params=act.params if act else [])
        fused = Node("FusedConv", inputs, [out], attrs, name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        view.refresh()
