"""Parallel GEMMs reading one input (attention's Q, K, V) -> one wider GEMM + Split.

One launch that reads the activation once instead of three. Quantized GEMMs (QGemm) merge
when they quantize that input alike (same type and scale): the input is then quantized once
too; their weight scales become one per output channel unless they were one and the same.

Plain MatMuls on constant [K, N] weights (bias-free projections, which fuse_gemm leaves as MatMul: Llama's
q/k/v and up) merge the same way into one MatMul. A SwiGLU's gate, a FusedGemm whose only epilogue is SiLU,
joins the MatMuls reading its input: its slice of the wide product gets the SiLU as Sigmoid and Mul, which
fuse_elementwise joins to the gate * up product that reads both slices (one GEMM fewer, no kernel more).
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name

_BIAS_AT = {"FusedGemm": 2, "QGemm": 4}  # (x, w, bias) and (x, w_q, x_scale, w_scale, bias)


def _key(view: View, n: Node) -> tuple | None:
    """What GEMMs must share to merge: input, epilogue, K and weight type (and, quantized, how x is quantized)."""
    if n.domain != "kiln" or n.op_type not in _BIAS_AT or view.const(n.inputs[1]) is None:
        return None
    w, at = view.const(n.inputs[1]), _BIAS_AT[n.op_type]
    key = (n.op_type, n.inputs[0], n.attr("activation", ""), tuple(n.attr("activation_params", [])),
           len(n.inputs) > at and bool(n.inputs[at]), w.shape[0], w.dtype)
    if n.op_type == "FusedGemm":
        return key
    x_scale = view.const(n.inputs[2])
    if len(n.inputs) > 5 or x_scale is None or x_scale.numel() != 1 or view.const(n.inputs[3]) is None:
        return None
    return key + (n.attr("qtype", "int8"), float(x_scale.reshape(-1)[0]), n.attr("x_quantized", 0))


def _weight_scales(view: View, gemms: list[Node], widths: list[int]) -> torch.Tensor:
    scales = [view.const(g.inputs[3]).float().reshape(-1) for g in gemms]
    if all(s.numel() == 1 for s in scales) and all(torch.equal(s, scales[0]) for s in scales):
        return scales[0].clone()
    return torch.cat([s.expand(n) for s, n in zip(scales, widths)])


def _plain_key(view: View, n: Node) -> tuple | None:
    """What plain GEMMs must share to merge into one MatMul: input, K, weight type. A MatMul on a constant 2-D
    float weight, or a FusedGemm whose only epilogue is SiLU (a SwiGLU's gate, its SiLU then applied apart)."""
    if not n.inputs or len(n.inputs) < 2:
        return None
    w = view.const(n.inputs[1])
    if w is None or w.dim() != 2 or not w.dtype.is_floating_point:
        return None
    if n.domain == "" and n.op_type == "MatMul":
        return n.inputs[0], w.shape[0], w.dtype
    if (n.domain == "kiln" and n.op_type == "FusedGemm" and n.attr("activation", "") == "Silu"
            and not (len(n.inputs) > 2 and n.inputs[2]) and not n.attr("output_type", "")):
        return n.inputs[0], w.shape[0], w.dtype
    return None


def _merge_plain(graph: Graph, view: View, gemms: list[Node]) -> None:
    """One MatMul on the concatenated weights + a Split; a SiLU gate's slice then goes through Sigmoid and Mul."""
    ws = [view.const(g.inputs[1]) for g in gemms]
    name = fused_name(gemms)
    w_name = f"merged_weight:{gemms[0].name}"
    graph.initializers[w_name] = torch.cat(ws, dim=1)
    wide = f"{gemms[0].outputs[0]}.merged"
    merged = Node("MatMul", [gemms[0].inputs[0], w_name], [wide], {}, name=name)
    split_sizes = f"split_sizes:{gemms[0].name}"
    graph.initializers[split_sizes] = torch.tensor([w.shape[1] for w in ws], dtype=torch.int64)
    silu = [g.op_type == "FusedGemm" for g in gemms]
    parts = [f"{g.outputs[0]}.pre_silu" if act else g.outputs[0] for g, act in zip(gemms, silu)]
    split = Node("Split", [wide, split_sizes], parts, {"axis": -1}, name=f"split({name})")
    merged.sources = [s for g in gemms for s in (g.sources or [g.name])]
    merged.opset = max(13, min(g.opset for g in gemms))
    split.opset, split.sources = merged.opset, [name]
    new = [merged, split]
    for g, part, act in zip(gemms, parts, silu):
        if act:
            sig = Node("Sigmoid", [part], [f"{part}.sigmoid"], {}, name=f"{g.outputs[0]}.sigmoid")
            mul = Node("Mul", [part, sig.outputs[0]], [g.outputs[0]], {}, name=f"{g.outputs[0]}.silu")
            for m in (sig, mul):
                m.opset = merged.opset
            new += [sig, mul]
    at = min(graph.nodes.index(g) for g in gemms)
    ids = {id(g) for g in gemms}
    graph.nodes = [n for n in graph.nodes[:at] if id(n) not in ids] + new + \
        [n for n in graph.nodes[at:] if id(n) not in ids]
    view.refresh()


def run(graph: Graph) -> None:
    view = View(graph)
    _merge_fused(graph, view)
    plain: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        key = _plain_key(view, n)
        if key is not None:
            plain.setdefault(key, []).append(n)
    for gemms in plain.values():
        # at least one MatMul: SiLU GEMMs alone merged above, as FusedGemms keeping their epilogue
        if len(gemms) >= 2 and any(g.op_type == "MatMul" for g in gemms):
            _merge_plain(graph, view, gemms)


def _merge_fused(graph: Graph, view: View) -> None:
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        key = _key(view, n)
        if key is not None:
            groups.setdefault(key, []).append(n)
    for key, gemms in groups.items():
        if len(gemms) < 2:
            continue
        quantized, has_bias, bias_at = key[0] == "QGemm", key[4], _BIAS_AT[key[0]]
        ws = [view.const(g.inputs[1]) for g in gemms]
        widths = [w.shape[1] for w in ws]
        name = fused_name(gemms)
        w_name = f"merged_weight:{gemms[0].name}"
        graph.initializers[w_name] = torch.cat(ws, dim=1)
        inputs = [key[1], w_name, gemms[0].inputs[2], "", ""] if quantized else [key[1], w_name, ""]
        if quantized:
            inputs[3] = f"merged_weight_scale:{gemms[0].name}"
            graph.initializers[inputs[3]] = _weight_scales(view, gemms, widths)
        if has_bias:
            b_name = f"merged_bias:{gemms[0].name}"
            graph.initializers[b_name] = torch.cat([view.const(g.inputs[bias_at]).reshape(-1) for g in gemms])
            inputs[bias_at] = b_name
        wide = f"{gemms[0].outputs[0]}.merged"
        merged = Node(key[0], inputs, [wide], dict(gemms[0].attrs), name=name, domain="kiln")
        split_sizes = f"split_sizes:{gemms[0].name}"
        graph.initializers[split_sizes] = torch.tensor(widths, dtype=torch.int64)
        split = Node("Split", [wide, split_sizes], [g.outputs[0] for g in gemms], {"axis": -1},
                     name=f"split({name})")
        # At the first GEMM's place: later layers may read the first GEMM's output before the last GEMM ran.
        at = min(graph.nodes.index(g) for g in gemms)
        merged.sources = [s for g in gemms for s in (g.sources or [g.name])]
        merged.opset = gemms[0].opset
        split.opset = max(13, merged.opset)
        split.sources = [name]
        ids = {id(g) for g in gemms}
        graph.nodes = [n for n in graph.nodes[:at] if id(n) not in ids] + [merged, split] + \
            [n for n in graph.nodes[at:] if id(n) not in ids]
        view.refresh()
