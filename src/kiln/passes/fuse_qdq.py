"""Explicit quantization: DQ(Q(x)) and DQ(int8/FP8 weights) around a MatMul/Gemm/Conv -> one quantized layer.

Q/DQ models (onnxruntime's quantizer, NVIDIA ModelOpt, Kiln's QAT export) say
where INT8 runs and with which scales; Kiln honours them: the layer multiplies
int8 activations by int8 weights and applies the scales (and bias, activation)
in its epilogue. A convolution's residual Add (ResNet's shortcut) and activation join it too
(QConv's optional 6th input z). Weights must be symmetric int8 or FP8 E4M3 (zero point 0), with one scale
per tensor or per output channel. ModelOpt writes FP8 weights either as FP8 initializers read by a
DequantizeLinear or as float weights through QuantizeLinear(FP8) -> DequantizeLinear; fold_constants turns
the second into the first (it keeps the DequantizeLinear of any one-byte codes), so both fuse alike.

An int8 activation with a zero point z (onnxruntime's quantizer writes asymmetric int8 activations by
default) is fused too: its QuantizeLinear stays and writes the codes q, the layer reads them as they are
(attribute x_quantized), and since s * (q - z) @ w = s * q @ w - s * z * (sum of w's column), the second
term joins the bias (per output channel). A padded convolution would read 0, not z, at a padded tap: a Pad
node pads its codes with z instead (one int8 pass) and the layer itself pads nothing.
A UINT8 activation pair with zero point z is first rewritten as the int8 pair with z - 128, which is the
same function (clamp(round(x/s) + z, 0, 255) - z = clamp(round(x/s) + z - 128, -128, 127) - (z - 128)).
Anything else keeps its Q/DQ nodes, runs in float, and a finding names the layer and what stopped it.
"""

from __future__ import annotations

import onnx
import torch

from ..engine.interpreter import call_node
from ..ir.graph import Graph, Node
from . import activations
from .rewrite import View, fused_name, miss, replace


def _dq_q(view: View, value: str):
    """value = DQ(Q(x, s, z), s, z) with one per-tensor scale and zero point, z = 0 unless int8:
    (x, scale name, [Q, DQ], z, the codes' torch dtype); None if value is not dequantized at all, else why the
    pair does not run in 8 bits, in the words of the finding."""
    dq = view.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        return None
    q = view.producer.get(dq.inputs[0])
    if q is None or q.op_type != "QuantizeLinear" or q.domain:
        if view.const(dq.inputs[0]) is not None:
            return "its first input is a dequantized constant, not a quantized activation"
        return (f"its input is dequantized from '{dq.inputs[0]}', which no QuantizeLinear writes (8-bit codes from "
                "outside the graph)")
    s = view.const(q.inputs[1])
    if s is None:
        return f"its input's scale '{q.inputs[1]}' is computed, not a constant"
    if s.numel() != 1:
        return (f"its input is quantized with {s.numel()} scales (per channel); an 8-bit layer takes one scale for "
                "its input")
    if q.inputs[1:] != dq.inputs[1:]:
        return "its input's QuantizeLinear and DequantizeLinear take different scales or zero points"
    if q.attr("block_size", 0):
        return f"its input is quantized in blocks of {q.attr('block_size')} (block_size)"
    has_zp = len(q.inputs) > 2 and bool(q.inputs[2])
    zp = view.const(q.inputs[2]) if has_zp else None
    if has_zp and (zp is None or zp.numel() != 1):
        return f"its input's zero point '{q.inputs[2]}' is not one constant"
    out_type = q.attr("output_dtype", 0)
    dtype = zp.dtype if zp is not None else next((t for t, o in _ONNX_TYPE.items() if o == out_type), torch.uint8)
    if dtype not in QTYPES or out_type not in (0, _ONNX_TYPE[dtype]):
        narrow = onnx.TensorProto.DataType.Name(out_type).lower()  # INT4 in an int8 carrier
        kind = narrow if out_type else str(dtype).removeprefix("torch.")
        return f"the activation is quantized as {kind}; int8 and FP8 E4M3 run"
    z = int(zp.float().reshape(-1)[0]) if zp is not None else 0
    if z and dtype != torch.int8:
        return f"its input's zero point is {z} ({_type_name(dtype)}); FP8 runs with zero point 0"
    if not z and view.readers(q.outputs[0]) != 1:  # Q goes with the pair: nothing else may read its codes
        return f"its input's 8-bit codes '{q.outputs[0]}' are read by other nodes too"
    return q.inputs[0], q.inputs[1], [q, dq], z, dtype  # with z, Q stays: other layers may read its codes too


QTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_ONNX_TYPE = {torch.int8: onnx.TensorProto.INT8, torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN}


def _type_name(dtype: torch.dtype) -> str:
    return QTYPES.get(dtype) or str(dtype).removeprefix("torch.")


def _dq_weight(view: View, value: str, channel_axis: int):
    """value = DQ(8-bit constant codes, per-channel or per-tensor scale, zero point 0): (dq, w_q, scale), the
    codes int8 or FP8 E4M3 (an initializer, or a float weight QuantizeLinear made, folded at build time).
    Otherwise why not, in the words of the finding (the layer then runs in float)."""
    dq = view.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        if view.const(value) is not None:
            return ("its weight is a float constant with no DequantizeLinear: the model quantizes this layer's input "
                    "but not its weight")
        return ("its second input is computed, not a weight (an activation times an activation, attention's "
                "products among them, runs in float)")
    w, s = view.const(dq.inputs[0]), view.const(dq.inputs[1])
    if w is None:
        return ("its second input is computed, not a weight (an activation times an activation, attention's "
                "products among them, runs in float)")
    if s is None:
        return f"the weight's scale '{dq.inputs[1]}' is computed, not a constant"
    if w.dtype not in QTYPES:
        return f"the weight is quantized as {_type_name(w.dtype)}; int8 and FP8 E4M3 weights run in 8 bits"
    zp = view.const(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] else None
    if len(dq.inputs) > 2 and dq.inputs[2] and zp is None:
        return f"the weight's zero point '{dq.inputs[2]}' is computed, not a constant"
    if zp is not None and zp.float().any():
        return "the weight's zero point is not 0 (Kiln runs symmetric weights)"
    if dq.attr("block_size", 0):
        return (f"the weight is quantized in blocks of {dq.attr('block_size')} (block_size); 8-bit layers take one "
                "scale per tensor or per output channel")
    if s.numel() != 1 and dq.attr("axis", 1) % w.dim() != channel_axis % w.dim():
        return (f"the weight's {s.numel()} scales run along axis {dq.attr('axis', 1)}, not along its output "
                f"channels (axis {channel_axis % w.dim()})")
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
        conv = mm.op_type == "Conv"
        trans_b = mm.op_type == "Gemm" and mm.attr("transB", 0)
        act_in = _dq_q(view, mm.inputs[0])
        weight = _dq_weight(view, mm.inputs[1], 0 if (conv or trans_b) else 1)
        if act_in is None:
            if isinstance(weight, tuple):  # weight-only 8-bit: nothing here multiplies 8-bit by 8-bit
                miss(graph, "8-bit layer", [mm], f"its weight is quantized ({_type_name(weight[1].dtype)}) but its "
                     "input is not (no QuantizeLinear/DequantizeLinear pair on it): an 8-bit layer quantizes both, so "
                     "the layer runs in float")
            continue
        reason = (act_in if isinstance(act_in, str) else weight if isinstance(weight, str) else
                  "it is a Gemm with transA, alpha or beta set" if mm.op_type == "Gemm" and (
                      mm.attr("transA", 0) or mm.attr("alpha", 1.0) != 1.0 or mm.attr("beta", 1.0) != 1.0) else
                  f"its input is quantized as {_type_name(act_in[4])} and its weight as {_type_name(weight[1].dtype)}"
                  ": an 8-bit layer takes one type for both" if act_in[4] != weight[1].dtype else None)
        if reason:
            miss(graph, "8-bit layer", [mm], f"{reason}; the layer runs in float")
            continue
        x, x_scale, qdq, z, _ = act_in
        dq_w, w_q, w_scale = weight
        if z and conv and mm.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            miss(graph, "INT8 layer", [mm], f"the activation's zero point is {z} and the convolution pads by "
                 f"auto_pad={mm.attr('auto_pad')}: Kiln pads the codes with the zero point only for explicit pads; "
                 "the layer runs in float")
            continue
        shared = view.readers(qdq[1].outputs[0]) > 1  # a Q/DQ pair other layers read stays for them (dead code later)
        # Likewise a weight's DequantizeLinear other layers read (a tied weight): each fused layer takes the codes.
        weight_dq = [dq_w] if view.readers(dq_w.outputs[0]) == 1 else []
        group = ([] if shared else qdq[1:] if z else qdq) + weight_dq + [mm]
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
                miss(graph, "INT8 layer", [mm], f"the activation's zero point is {z} and the bias is not a constant; "
                     "the layer runs in float")
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
