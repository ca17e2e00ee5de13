"""Explicit quantization: DQ(Q(x)) and DQ(int8/FP8 weights) around a MatMul/Gemm/Conv -> one quantized layer.

Q/DQ models (onnxruntime's quantizer, NVIDIA ModelOpt, Kiln's QAT export) say
where INT8 runs and with which scales; Kiln honours them: the layer multiplies
int8 activations by int8 weights and applies the scales (and bias, activation)
in its epilogue. A convolution's residual Add (ResNet's shortcut) and activation join it too
(QConv's optional 6th input z). Weights must be symmetric int8 or FP8 E4M3 (zero point 0).

An int8 activation with a zero point z (onnxruntime's quantizer writes asymmetric int8 activations by
default) is fused too: its QuantizeLinear stays and writes the codes q, the layer reads them as they are
(attribute x_quantized), and since s * (q - z) @ w = s * q @ w - s * z * (sum of w's column), the second
term joins the bias (per output channel). A padded convolution would read 0, not z, at a padded tap: a Pad
node pads its codes with z instead (one int8 pass) and the layer itself pads nothing.
A UINT8 activation pair with zero point z is first rewritten as the int8 pair with z - 128, which is the
same function (clamp(round(x/s) + z, 0, 255) - z = clamp(round(x/s) + z - 128, -128, 127) - (z - 128)).
Anything else keeps its Q/DQ nodes, runs in float, and the reason is recorded.
"""

from __future__ import annotations

import onnx
import torch

from ..engine.interpreter import call_node
from ..ir.graph import Graph, Node
from . import activations, fold_constants
from .rewrite import View, fused_name, miss, replace


def _dq_q(view: View, value: str):
    """value = DQ(Q(x, s, z), s, z) with one per-tensor scale and zero point, z = 0 unless int8:
    (x, scale name, [Q, DQ], z); None if value is no such pair, the reason if its zero point does not do."""
    dq = view.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        return None
    q = view.producer.get(dq.inputs[0])
    if q is None or q.op_type != "QuantizeLinear" or q.domain:
        return None
    s = view.const(q.inputs[1])
    if s is None or s.numel() != 1 or q.inputs[1:] != dq.inputs[1:]:
        return None
    zp = view.const(q.inputs[2]) if len(q.inputs) > 2 and q.inputs[2] else None
    if zp is None or zp.numel() != 1 or q.attr("block_size", 0):
        return None
    if zp.dtype not in QTYPES or q.attr("output_dtype", 0) not in (0, _ONNX_TYPE[zp.dtype]):
        narrow = onnx.TensorProto.DataType.Name(q.attr("output_dtype", 0)).lower()  # INT4 in an int8 carrier
        kind = narrow if q.attr("output_dtype", 0) else str(zp.dtype).removeprefix("torch.")
        return f"the activation is quantized as {kind}; int8 and FP8 E4M3 run"
    z = int(zp.float().reshape(-1)[0])
    if z and zp.dtype != torch.int8:
        return None
    if not z and view.readers(q.outputs[0]) != 1:  # Q goes with the pair: nothing else may read its codes
        return None
    return q.inputs[0], q.inputs[1], [q, dq], z  # with z, Q stays: other layers may read its codes too


QTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_ONNX_TYPE = {torch.int8: onnx.TensorProto.INT8, torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN}


def _int8_zero(view: View, n: Node) -> bool:
    """Zero point 0 of a type Kiln runs (int8, or FP8 E4M3), no blocked quantization."""
    zp = view.const(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
    return zp is not None and zp.dtype in QTYPES and not zp.float().any() and not n.attr("block_size", 0)


def _dq_weight(view: View, value: str, channel_axis: int):
    """value = DQ(int8 constant, per-channel or per-tensor scale, zero point 0): (dq, w_q, scale)."""
    dq = view.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain or view.readers(value) != 1:
        return None
    w, s = view.const(dq.inputs[0]), view.const(dq.inputs[1])
    if w is None or s is None or w.dtype not in QTYPES or not _int8_zero(view, dq):
        return None
    if s.numel() != 1 and dq.attr("axis", 1) % w.dim() != channel_axis % w.dim():
        return None
    return dq, w, s


def _zero_point_pad(codes: str, conv: Node, z: int, name: str, graph: Graph) -> Node:
    """A Pad of a convolution's int8 codes with the zero point z, as wide as the convolution's pads."""
    pads = conv.attr("pads")
    k = len(pads) // 2
    graph.initializers[f"{name}.zero_point_pads"] = torch.tensor([0, 0, *pads[:k], 0, 0, *pads[k:]], dtype=torch.int64)
    graph.initializers[f"{name}.zero_point"] = torch.tensor(z, dtype=torch.int8)
    return Node("Pad", [codes, f"{name}.zero_point_pads", f"{name}.zero_point"], [f"{name}.padded_codes"],
                {"mode": "constant"}, name=f"{name}.pad_with_zero_point", opset=max(conv.opset, 11))


def _zero_point_bias(w_q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor, z: int,
                     conv: bool) -> torch.Tensor:
    """-s * z * sw[n] * (sum of output channel n's weights): the zero point's share of the product, as a
    bias. w_q as the fused layer stores it ([K, N], a convolution's [OC, C, ..])."""
    sums = w_q.double().flatten(1).sum(1) if conv else w_q.double().sum(0)
    return -float(x_scale.reshape(-1)[0]) * z * w_scale.double().reshape(-1) * sums


def _bias_values(view: View, bias: str) -> tuple[torch.Tensor | None, Node | None]:
    """(a bias's values, the DequantizeLinear that makes them or None): a constant, or the dequantized int32
    constant onnxruntime's quantizer writes; (None, None) for anything else."""
    b = view.const(bias)
    dq = view.producer.get(bias)
    if b is not None or dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        return b, None
    args = [view.const(i) if i else None for i in dq.inputs]
    if any(a is None for a, i in zip(args, dq.inputs) if i):
        return None, None
    return call_node(dq, args)[0], dq  # as fold_constants evaluates a node of constants


def _uint8_as_int8(graph: Graph, view: View) -> None:
    """Each per-tensor UINT8 Q whose codes only DQs with its scale and zero point read becomes the int8 Q/DQ
    pair with zero point z - 128."""
    for q in [n for n in graph.nodes if n.op_type == "QuantizeLinear" and not n.domain and len(n.inputs) > 2]:
        zp = view.const(q.inputs[2]) if q.inputs[2] else None
        readers = view.consumers.get(q.outputs[0], [])
        if (zp is None or zp.dtype != torch.uint8 or zp.numel() != 1 or q.attr("block_size", 0) or not readers
                or q.attr("output_dtype", 0) not in (0, onnx.TensorProto.UINT8)  # UINT4 in a uint8 carrier
                or q.outputs[0] in view.outputs
                or any(r.op_type != "DequantizeLinear" or r.domain or r.inputs[1:] != q.inputs[1:] for r in readers)):
            continue
        shifted = f"{q.inputs[2]}.as_int8"
        graph.initializers[shifted] = (zp.to(torch.int16) - 128).to(torch.int8)
        for n in [q, *readers]:
            n.inputs[2] = shifted
        if q.attr("output_dtype", 0):
            q.attrs["output_dtype"] = onnx.TensorProto.INT8
    view.refresh()


def run(graph: Graph) -> None:
    view = View(graph)
    _uint8_as_int8(graph, view)
    for mm in [n for n in graph.nodes if n.op_type in ("MatMul", "Gemm", "Conv") and not n.domain]:
        act_in = _dq_q(view, mm.inputs[0])
        if isinstance(act_in, str):
            miss(graph, "INT8 layer", [mm], act_in)
        if not isinstance(act_in, tuple):
            continue
        conv = mm.op_type == "Conv"
        trans_b = mm.op_type == "Gemm" and mm.attr("transB", 0)
        weight = _dq_weight(view, mm.inputs[1], 0 if (conv or trans_b) else 1)
        if weight is None:
            dq = view.producer.get(mm.inputs[1])
            constant = dq is not None and dq.op_type == "DequantizeLinear" and view.const(dq.inputs[0]) is not None
            miss(graph, "INT8 layer", [mm], "the weights are not int8 constants with zero point 0 and "
                 "per-output-channel (or per-tensor) scales" if constant or mm.inputs[1] in graph.initializers else
                 "its second input is computed, not a weight (an activation times an activation, attention's "
                 "products among them, runs in float)")
            continue
        if mm.op_type == "Gemm" and (mm.attr("transA", 0) or mm.attr("alpha", 1.0) != 1.0
                                     or mm.attr("beta", 1.0) != 1.0):
            continue
        x, x_scale, qdq, z = act_in
        dq_w, w_q, w_scale = weight
        zp_x = view.const(qdq[0].inputs[2])
        if zp_x.dtype != w_q.dtype:
            miss(graph, "quantized layer", [mm], "activation and weight quantization types differ")
            continue
        if z and conv and mm.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            miss(graph, "INT8 layer", [mm], f"the activation's zero point is {z} and the convolution pads by "
                 f"auto_pad={mm.attr('auto_pad')}: Kiln pads the codes with the zero point only for explicit pads")
            continue
        shared = view.readers(qdq[1].outputs[0]) > 1  # a Q/DQ pair other layers read stays for them (dead code later)
        group = ([] if shared else qdq[1:] if z else qdq) + [dq_w, mm]
        if z:  # the layer reads Q's codes; Q stays
            x = qdq[0].outputs[0]
        name = fused_name([mm])
        graph.initializers[f"{name}.weight_q"] = w_q.t().contiguous() if trans_b else w_q
        n_out = w_q.shape[0] if (conv or trans_b) else w_q.shape[1]
        # One scale per tensor (kept as one: cuBLASLt's FP8 GEMM takes no other) or one per output channel.
        graph.initializers[f"{name}.weight_scale"] = w_scale.float().reshape(-1).contiguous()
        bias, out = "", mm.outputs[0]
        if conv or mm.op_type == "Gemm":
            bias = mm.inputs[2] if len(mm.inputs) > 2 else ""
        add = view.sole_reader(out)
        other = view.other_input(add, out) if add is not None and add.op_type == "Add" and not add.domain else None
        residual = ""
        if other and not bias and not conv:
            b = view.const(other)
            if b is not None and b.numel() == n_out:
                bias, out = other, add.outputs[0]
                group.append(add)
        elif other and conv and view.const(other) is None and not any(other in n.outputs for n in group + [add]):
            # ResNet's shortcut: Conv + Add(tensor) (+ Relu) -> one QConv with a residual input, added in its epilogue
            residual, out = other, add.outputs[0]
            group.append(add)
        if z:
            b, bias_dq = _bias_values(view, bias) if bias else (None, None)
            if bias and b is None:
                miss(graph, "INT8 layer", [mm], f"the activation's zero point is {z} and the bias is not a constant")
                continue
            if bias_dq is not None and view.readers(bias) == 1:
                group.append(bias_dq)
            shift = _zero_point_bias(graph.initializers[f"{name}.weight_q"], w_scale, view.const(x_scale), z, conv)
            bias = f"{name}.bias_with_zero_point"
            graph.initializers[bias] = (shift + (b.double().reshape(-1) if b is not None else 0)).float()
        act = activations.match(view, out)
        if act is not None:
            group += act.nodes
            out = act.output
        attrs = dict(mm.attrs) if conv else {}
        attrs.update(activation=act.name if act else "", activation_params=act.params if act else [],
                     qtype=QTYPES[w_q.dtype], **({"x_quantized": 1} if z else {}))
        pad = None
        if z and conv and any(mm.attr("pads", [])):
            pad = _zero_point_pad(x, mm, z, name, graph)
            x, attrs["pads"] = pad.outputs[0], [0] * len(mm.attr("pads"))
        inputs = [x, f"{name}.weight_q", x_scale, f"{name}.weight_scale", bias] + ([residual] if residual else [])
        fused = Node("QConv" if conv else "QGemm", inputs, [out], attrs, name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        if pad is not None:
            graph.nodes.insert(next(i for i, n in enumerate(graph.nodes) if n is fused), pad)
        view.refresh()
    fold_constants.run(graph, keep_quantized=False)  # weights of layers left in float
