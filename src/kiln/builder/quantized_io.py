"""8-bit activations between quantized layers.

When every reader of an INT8/FP8 layer's output is a quantized layer of the same type that
quantizes its input with the same scale, the producer quantizes in its epilogue (input
y_scale) and writes the 8-bit values; the readers take them as they are (attribute
x_quantized). One byte per element crosses memory instead of a float written, read and
quantized again, and the readers' GEMMs read 8-bit tiles straight from memory. Readers
compute their epilogue in the engine's float type (attribute float_type), since their
input no longer carries one. Every quantized layer records that type, so a float fallback
computes in 16 bits only where the build allowed 16-bit floats.

An output read both as float and by quantized layers is written twice instead, float and as an
8-bit copy for the quantized readers (input q_scale, one more output): a residual add + LayerNorm
(kiln::SkipLayerNorm; attribute qtype), whose rows BERT's QKV and FFN1 GEMMs read and the next
residual adds, and a QConv, whose output (a ResNet block's) the next block's first convolution
reads and its last one adds as the residual. Those readers then need no quantize pass. A plain
LayerNormalization that quantized layers read (BERT's embedding norm, before the first QKV GEMM)
becomes a SkipLayerNorm without the skip to get the copy. A max pool read only by quantized layers (ResNet's
stem pool), and stem patches (passes/stem_patches.py), write their 8-bit input instead of their float output,
and a QConv read only as other QConvs' residual (a ResNet stage's downsampling shortcut) writes it in 8 bits.

A QConv adding such a block output as its residual reads the copy too, scaled back in its epilogue (input
z_scale), and a block output that no layer reads as float any more is written once, as 8-bit values. The
copy's scale (the next convolution's input scale) must then cover every value calibration saw of the block
output: entropy calibration clips the long tails of ReLU outputs, which suits a convolution's input but not
a sum carried down the network (three 64-channel blocks ended 47% of their range off onnxruntime with
residuals clipped so, 1.1% with float ones). Where it would clip, the scale is widened to the calibrated
maximum, for the next convolution too; the layer's note says so. That was as accurate as a second 8-bit
output at the wide scale beside the clipped copy (the same 1.7% on those blocks, 98.06% top-1 on a trained
residual digits CNN with every calibrator, against 97.78-98.06%), and at ResNet-50's 56x56 stage a block's
last convolution moves 58 MB (8-bit input, residual, output) instead of 84 MB with two outputs, or 135 MB
with a float residual and output. Without calibration statistics (a Q/DQ model, a TensorRT cache)
residuals stay float.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from ..passes.insert_qdq import FP8_MAX

QUANTIZED = ("QGemm", "QConv")
Y_SCALE_INPUT = {"QGemm": 5, "QConv": 6}  # after (x, w_q, x_scale, w_scale, bias[, z])
# Producers that can also write an 8-bit copy: (input q_scale, output of the copy)
COPY_AT = {"SkipLayerNorm": (4, 2), "QConv": (7, 1)}
Z_SCALE_INPUT = 8  # a QConv's residual scale, after (x, w_q, x_scale, w_scale, bias, z, y_scale, q_scale)
ATTENTION_Y_SCALE = 4  # after (q, k, v, mask)
QKV_SCALE_INPUT = 5  # an Attention's FP8 q/k/v scale, after (q, k, v, mask, y_scale)
POOL_Y_SCALE = 1  # a MaxPool's or StemPatches' (Kiln's input, after x): its quantized readers' scale
QGEMM_Y_SCALE = Y_SCALE_INPUT["QGemm"]
# Ops that only view their input (the head merge between attention and its output projection): 8-bit values
# pass through them unchanged.
VIEWS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze")


def output_scale(n: Node) -> str:
    """The scale input of a layer that writes its output as 8-bit values for the quantized layers after it, else ""
    (a QGemm's or QConv's y_scale, an attention's, a max pool's)."""
    if n.domain == "kiln" and n.op_type in Y_SCALE_INPUT:
        at = Y_SCALE_INPUT[n.op_type]
    elif n.domain == "kiln" and n.op_type == "Attention":
        at = ATTENTION_Y_SCALE
    elif _rearranges(n):
        at = POOL_Y_SCALE
    else:
        return ""
    return _input(n, at)


def _qmax(qtype: str) -> float:
    """The largest 8-bit value of qtype: a scale of absmax / _qmax(qtype) clips nothing."""
    return FP8_MAX if qtype == "fp8" else 127.0


def _input(n: Node, at: int) -> str:
    """The name of n's input `at`, "" where it is left out."""
    return n.inputs[at] if len(n.inputs) > at else ""


def _set_input(n: Node, at: int, name: str) -> None:
    """Input `at` of n set to `name`, the optional inputs before it left empty."""
    n.inputs = n.inputs + [""] * (at + 1 - len(n.inputs))
    n.inputs[at] = name


def _adds_residual(c: Node, value: str, qtype: str) -> bool:
    """c is a quantized convolution of `qtype` adding `value` as its residual (input 5) and reading it nowhere else."""
    return (_quantized(c) and c.op_type == "QConv" and _input(c, 5) == value and value not in c.inputs[:5]
            and c.attr("qtype", "int8") == qtype)


def _is_view(n: Node) -> bool:
    return n.op_type in VIEWS and n.domain in ("", "ai.onnx")


def _quantized(n: Node) -> bool:
    return n.domain == "kiln" and n.op_type in QUANTIZED and n.placement == "device"


def _reads_as_x(r: Node, value: str) -> bool:
    """A quantized layer that reads `value` as its activation input x, and nowhere else."""
    return _quantized(r) and r.inputs[0] == value and value not in r.inputs[1:]


def _x_scale(graph: Graph, r: Node) -> float | None:
    """The constant scale a quantized layer quantizes its input with, else None."""
    s = graph.initializers.get(r.inputs[2])
    return float(s.reshape(-1)[0]) if s is not None else None


def link(graph: Graph, float_precision: str) -> None:
    """Link producer/reader pairs in place."""
    readers = graph.consumers()
    outputs = {v.name for v in graph.outputs}
    float_type = float_precision if float_precision in ("float16", "bfloat16") else "float32"
    for n in graph.nodes:
        if _quantized(n):
            n.attrs.setdefault("float_type", float_type)  # FP32 where the precision guard widened it
    _biases_in(graph, readers)
    for n in graph.nodes:
        out = n.outputs[0] if n.outputs else ""
        users = readers.get(out, [])
        if not _quantized(n) or not users or out in outputs:
            continue
        qtype = n.attr("qtype", "int8")
        if not all(_reads_as_x(r, out) and r.attr("qtype", "int8") == qtype for r in users):
            continue
        scales = {_x_scale(graph, r) for r in users}
        if len(scales) != 1 or None in scales:
            continue
        at = Y_SCALE_INPUT[n.op_type]
        _set_input(n, at, users[0].inputs[2])
        for r in users:
            r.attrs["x_quantized"] = 1
    _quantized_rearrangements(graph, readers, outputs)
    _pools_of_8_bit_values(graph, readers, outputs)
    for n in graph.nodes:
        if (n.domain == "kiln" and n.op_type in COPY_AT and n.placement == "device" and n.outputs) or _plain_norm(n):
            _copy_for_quantized_readers(graph, n, readers.get(n.outputs[0], []))
    _quantized_residuals(graph)
    _quantized_shortcuts(graph)
    _quantized_attention(graph, readers, outputs)
    _fp8_attention_inputs(graph, readers, outputs, float_type)


def _quantized_shortcuts(graph: Graph) -> None:
    """A QConv read only as other QConvs' residual (the downsampling shortcut that starts each ResNet stage) writes
    it as 8-bit values at the scale of its calibrated maximum (no clipping, as for the block outputs above), which
    they scale back in their epilogues: half the bytes written and read. Without calibration statistics it stays
    float."""
    absmax = graph.quant_absmax or {}
    readers = graph.consumers()
    outputs = {v.name for v in graph.outputs}
    at_y = Y_SCALE_INPUT["QConv"]
    for p in [n for n in graph.nodes if _quantized(n) and n.op_type == "QConv"]:
        out, qtype = p.outputs[0], p.attr("qtype", "int8")
        if any(p.outputs[1:]) or out in outputs or _input(p, at_y):
            continue
        users = readers.get(out, [])
        if not users or not all(_adds_residual(c, out, qtype) and not _input(c, Z_SCALE_INPUT) for c in users):
            continue
        seen = absmax.get(out)
        if seen is None or not seen > 0:
            continue
        scale = f"{out}.shortcut_scale"
        graph.initializers[scale] = torch.tensor(seen / _qmax(qtype), dtype=torch.float32)
        _set_input(p, at_y, scale)
        for c in users:
            _set_input(c, Z_SCALE_INPUT, scale)


def _max_pool(n: Node) -> bool:
    return n.op_type == "MaxPool" and n.domain in ("", "ai.onnx")


def _rearranges(n: Node) -> bool:
    """A max pool or stem patches: layers whose output values are input values, so quantizing the output is
    quantizing the input they took."""
    return _max_pool(n) or (n.op_type == "StemPatches" and n.domain == "kiln")


def _quantized_rearrangements(graph: Graph, readers: dict, outputs: set) -> None:
    """A max pool read only by quantized layers that quantize it with one scale (ResNet's stem pool, read by the
    first block's two convolutions) writes their 8-bit input itself (input y_scale): the max of rounded values is
    the rounded max, and each reader's quantize pass over the pool's float output goes. So do stem patches, read
    by the stem convolution."""
    for n in graph.nodes:
        if not (_rearranges(n) and n.placement == "device" and n.outputs
                and len(n.inputs) == 1 and not any(n.outputs[1:]) and n.outputs[0] not in outputs):
            continue  # values only (no Indices output), not a graph output
        users = readers.get(n.outputs[0], [])
        if not users or not all(_reads_as_x(r, n.outputs[0]) and not r.attr("x_quantized", 0) for r in users):
            continue
        kinds = {(r.attr("qtype", "int8"), _x_scale(graph, r)) for r in users}
        if len(kinds) != 1 or None in next(iter(kinds)):
            continue
        _set_input(n, POOL_Y_SCALE, users[0].inputs[2])
        n.attrs["qtype"] = next(iter(kinds))[0]
        for r in users:
            r.attrs["x_quantized"] = 1


def _pools_of_8_bit_values(graph: Graph, readers: dict, outputs: set) -> None:
    """A max pool writing 8-bit values (above) that is the only reader of a QConv of its 8-bit type (ResNet's stem,
    once passes/stem_patches.py made it 8-bit) reads 8-bit values too: the QConv quantizes with the pool's scale
    and the pool takes the max of the rounded values, which is the rounded max. At batch 32 that is 26 MB written
    and read instead of ResNet-50's 51 MB of FP16 stem output."""
    producers = graph.producers()
    at_y = Y_SCALE_INPUT["QConv"]
    for n in graph.nodes:
        if not (_max_pool(n) and _input(n, POOL_Y_SCALE)):
            continue
        p = producers.get(n.inputs[0])
        if (p is None or not _quantized(p) or p.op_type != "QConv" or p.attr("qtype", "int8") != n.attr("qtype")
                or any(p.outputs[1:]) or p.outputs[0] in outputs or _input(p, at_y)
                or [r is n for r in readers.get(p.outputs[0], [])] != [True]):
            continue
        _set_input(p, at_y, n.inputs[POOL_Y_SCALE])
        n.attrs["x_quantized"] = 1


def _quantized_attention(graph: Graph, readers: dict, outputs: set) -> None:
    """An attention whose result reaches one quantized layer only through views (BERT: Reshape, Transpose,
    Reshape, then the output projection) writes it as that layer's 8-bit input: the flash kernel quantizes in
    its epilogue instead of the projection in a pass of its own."""
    for n in graph.nodes:
        if not (n.domain == "kiln" and n.op_type == "Attention" and n.placement == "device" and n.outputs):
            continue
        value = n.outputs[0]
        while len(readers.get(value, [])) == 1 and value not in outputs:
            r = readers[value][0]
            if _is_view(r) and r.inputs[0] == value:
                value = r.outputs[0]
                continue
            if _reads_as_x(r, value) and not r.attr("x_quantized", 0) and _x_scale(graph, r) is not None:
                _set_input(n, ATTENTION_Y_SCALE, r.inputs[2])
                n.attrs["qtype"] = r.attr("qtype", "int8")
                r.attrs["x_quantized"] = 1
            break


def _fp8_attention_inputs(graph: Graph, readers: dict, outputs: set, float_type: str) -> None:
    """An FP8 engine's merged QKV projection (QGemm, Split, head views, Attention) writes FP8 codes of one scale, the
    calibrated maximum of its output, and the attention reads them (input qkv_scale): half the bytes of the
    projection's output and of the attention's input. The maximum, not a clipping calibrator's range: an outlier
    in q or k decides where the softmax peaks."""
    absmax = graph.quant_absmax or {}
    made_by = graph.producers()
    for n in graph.nodes:
        if not (n.domain == "kiln" and n.op_type == "Attention" and n.placement == "device" and len(n.inputs) >= 3):
            continue
        starts = [_before_views(v, made_by, readers, outputs) for v in n.inputs[:3]]
        split = made_by.get(starts[0])
        if (split is None or split.op_type != "Split" or len(set(starts)) != 3
                or sorted(starts) != sorted(split.outputs) or any(len(readers.get(v, [])) != 1 for v in starts)):
            continue
        gemm, wide = made_by.get(split.inputs[0]), split.inputs[0]
        if (gemm is None or not _quantized(gemm) or gemm.op_type != "QGemm" or gemm.attr("qtype", "int8") != "fp8"
                or len(readers.get(wide, [])) != 1 or wide in outputs
                or _input(gemm, QGEMM_Y_SCALE)):
            continue
        seen = absmax.get(wide)
        if seen is None or not seen > 0:
            continue
        scale = f"{wide}.fp8_scale"
        graph.initializers[scale] = torch.tensor(seen / FP8_MAX, dtype=torch.float32)
        _set_input(gemm, QGEMM_Y_SCALE, scale)
        _set_input(n, QKV_SCALE_INPUT, scale)
        n.attrs["float_type"] = float_type


def _before_views(value: str, made_by: dict, readers: dict, outputs: set) -> str:
    """The value a chain of views (each read by the next alone) starts from: Split's output for BERT's q, k, v."""
    while True:
        p = made_by.get(value)
        if p is None or not _is_view(p) or p.inputs[0] in outputs:
            return value
        if len(readers.get(p.inputs[0], [])) != 1 or len([o for o in p.outputs if o]) != 1:
            return value
        value = p.inputs[0]


def _biases_in(graph: Graph, readers: dict) -> None:
    """Quantized layers' constant biases stored in their float type, as their reference adds them: a tactic that
    wants the float type (cuBLASLt's FP8 GEMM) then casts nothing per call. A bias its readers want in two types
    stays as it is."""
    from ..ir.dtypes import from_name

    for n in graph.nodes:
        bias = _input(n, 4) if _quantized(n) else ""
        t = graph.initializers.get(bias)
        users = readers.get(bias, [])
        types = {r.attr("float_type") for r in users if _quantized(r)}
        if t is None or len(types) != 1 or not all(_quantized(r) for r in users):
            continue
        dtype = from_name(types.pop())
        if t.dtype != dtype:
            graph.initializers[bias] = t.to(dtype)


def _plain_norm(n: Node) -> bool:
    """An ONNX LayerNormalization on the device over the last axis, in FP32 statistics, writing only its result:
    what a SkipLayerNorm without the skip computes."""
    return (n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx") and n.placement == "device"
            and n.attr("axis", -1) == -1 and n.attr("stash_type", 1) == 1 and not any(n.outputs[1:]))


def _as_skip_layer_norm(n: Node) -> None:
    """Rewrite a _plain_norm in place as kiln::SkipLayerNorm(x, no skip, gamma, beta), which can write an 8-bit
    copy of its rows."""
    n.op_type, n.domain = "SkipLayerNorm", "kiln"
    n.inputs = [n.inputs[0], ""] + n.inputs[1:3]
    n.outputs = [n.outputs[0]]
    n.attrs = {"epsilon": n.attr("epsilon", 1e-5)}


def _copy_for_quantized_readers(graph: Graph, n: Node, users: list[Node]) -> None:
    """Give n an 8-bit copy of its output when quantized layers read it with one scale (others as float)."""
    out = n.outputs[0]
    quantized = [r for r in users if _reads_as_x(r, out) and not r.attr("x_quantized", 0)]
    kinds = {(r.attr("qtype", "int8"), _x_scale(graph, r)) for r in quantized}
    if not quantized or len(kinds) != 1 or None in next(iter(kinds)):
        return
    qtype = next(iter(kinds))[0]
    at_y = Y_SCALE_INPUT.get(n.op_type)
    if at_y is not None and (n.attr("qtype", "int8") != qtype or _input(n, at_y)):
        return  # a copy in another 8-bit type than the layer's, or an output that is 8-bit already
    if _plain_norm(n):
        _as_skip_layer_norm(n)
    at_in, at_out = COPY_AT[n.op_type]
    copy = f"{out}.{qtype}"
    _set_input(n, at_in, quantized[0].inputs[2])
    n.outputs = n.outputs + [""] * (at_out - len(n.outputs)) + [copy]
    n.attrs["qtype"] = qtype
    for r in quantized:
        r.inputs[0] = copy
        r.attrs["x_quantized"] = 1


def _quantized_residuals(graph: Graph) -> None:
    """QConv residuals in 8 bits, producer by producer: the next convolution's 8-bit copy of a block output is
    also the residual, its scale widened where it would clip the calibrated maximum; a float output nobody reads
    any more is dropped."""
    absmax = graph.quant_absmax or {}
    readers = graph.consumers()
    outputs = {v.name for v in graph.outputs}
    at_y, at_copy = Y_SCALE_INPUT["QConv"], COPY_AT["QConv"][0]
    for p in [n for n in graph.nodes if _quantized(n) and n.op_type == "QConv" and len(n.outputs) > 1 and n.outputs[1]]:
        out, copy, qtype = p.outputs[0], p.outputs[1], p.attr("qtype", "int8")
        users = readers.get(out, [])
        adders = [c for c in users if _adds_residual(c, out, qtype)]
        seen, copy_scale = absmax.get(out), graph.initializers.get(p.inputs[at_copy])
        if not adders or seen is None or copy_scale is None:
            continue
        qmax = _qmax(qtype)
        narrow = float(copy_scale.reshape(-1)[0])
        if narrow * qmax < seen * (1 - 1e-5):  # (1 - 1e-5): FP32 rounding of the scale
            wide = f"{out}.block_scale"
            graph.initializers[wide] = torch.tensor(seen / qmax, dtype=torch.float32)
            for r in readers.get(copy, []):
                r.inputs[2] = wide
            p.inputs[at_copy] = wide
            p.note = (p.note + "; " if p.note else "") + (
                f"8-bit output scale widened from {narrow:.3g} to {seen / qmax:.3g}: the calibrated maximum "
                "of a block output that is also a residual")
        for c in adders:
            _set_input(c, Z_SCALE_INPUT, p.inputs[at_copy])
            c.inputs[5] = copy
        if len(adders) == len(users) and out not in outputs:
            # only the copy is read: written as the output itself; p's own z_scale (a block between two others)
            # stays
            p.inputs[at_y], p.inputs[at_copy] = p.inputs[at_copy], ""
            p.outputs = [copy]
