"""MatMul/Gemm + bias + activation -> one kiln::FusedGemm layer (weights stored [K, N]).

One cuBLASLt call with a bias/activation epilogue replaces two or three kernels. A plain MatMul becomes one
too when it computes a model output (an LM head): a FusedGemm can write the model's FP32 output itself
(builder/precision.py), where a MatMul's FP16 result would be cast by one more pass over the logits.
The weight may be a Transpose of a constant [N, K]: a tied LM head reads the embedding table so, too big
for fold_constants to fold; the layer gets its own [K, N] copy.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from . import activations
from .rewrite import View, fused_name, replace


def _bias_of(view: View, value: str, n_out: int):
    """An Add of a constant [N] (or broadcastable [1.., N]) vector to `value`: (add node, bias name)."""
    add = view.sole_reader(value)
    if add is None or add.op_type != "Add" or add.domain:
        return None, None
    other = view.other_input(add, value)
    b = view.const(other) if other else None
    if b is None or b.numel() != n_out or (b.dim() and b.shape[-1] != n_out):
        return None, None
    return add, other


def _transposed_const(view: View, value: str):
    """The [K, N] view of a 2-D constant that `value` reads through Transpose(perm=[1, 0]), else None."""
    t = view.producer.get(value)
    if t is None or t.op_type != "Transpose" or t.domain or list(t.attr("perm", [1, 0])) != [1, 0]:
        return None
    w = view.const(t.inputs[0])
    return w.t() if w is not None and w.dim() == 2 else None


def _writes_output(view: View, value: str) -> bool:
    """Whether `value` is a model output, or is read only by a Slice/Reshape producing one (a view of it)."""
    if value in view.outputs:
        return True
    reader = view.sole_reader(value)
    return (reader is not None and reader.op_type in ("Slice", "Reshape") and not reader.domain
            and reader.inputs[0] == value and reader.outputs[0] in view.outputs)


def run(graph: Graph) -> None:
    view = View(graph)
    for mm in [n for n in graph.nodes if n.op_type in ("MatMul", "Gemm") and n.domain == ""]:
        w = view.const(mm.inputs[1])
        w_name = mm.inputs[1]
        transposed = _transposed_const(view, w_name) if w is None and mm.op_type == "MatMul" else None
        if transposed is not None:
            w, w_name = transposed, f"{mm.name}.weight_kn"
        if w is None or w.dim() != 2 or not w.dtype.is_floating_point:
            continue
        group, bias = [mm], None
        if mm.op_type == "Gemm":
            if mm.attr("transA", 0) or mm.attr("alpha", 1.0) != 1.0 or mm.attr("beta", 1.0) != 1.0:
                continue
            if mm.attr("transB", 0):  # store [K, N] once, at build time
                w_name = f"{mm.name}.weight_kn"
                graph.initializers[w_name] = w.t().contiguous()
            n_out = graph.initializers[w_name].shape[1]
            c = mm.inputs[2] if len(mm.inputs) > 2 and mm.inputs[2] else None
            if c is not None:
                cb = view.const(c)
                if cb is None or cb.numel() != n_out:
                    continue
                bias = c
        else:
            n_out = w.shape[1]
        out = mm.outputs[0]
        if bias is None:
            add, bias = _bias_of(view, out, n_out)
            if add is not None:
                group.append(add)
                out = add.outputs[0]
        act = activations.match(view, out)
        if act is not None:
            group += act.nodes
            out = act.output
        if len(group) == 1 and mm.op_type == "MatMul" and not _writes_output(view, out):
            continue  # a plain MatMul inside the graph gains nothing from becoming a FusedGemm
        if transposed is not None:
            graph.initializers[w_name] = w.contiguous()
        attrs = {"activation": act.name if act else "", "activation_params": act.params if act else []}
        fused = Node("FusedGemm", [mm.inputs[0], w_name, bias or ""], [out], attrs, name=fused_name(group),
                     domain="kiln")
        replace(graph, group, fused)
        view.refresh()
