"""Explicit quantization: Q/DQ models run their MatMul/Conv on int8, matching onnxruntime."""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli import main
from kiln.ir.graph import Node
from kiln.passes import fuse_qdq
from kiln.tactics.library import int8_int_mm

from .util import check_pass, model, ops, rand


def _qdq_mlp(zero_point=0):
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (16, 24)).astype(np.int8)
    inits = [
        numpy_helper.from_array(np.float32(0.05), "sx"), numpy_helper.from_array(np.int8(zero_point), "zx"),
        numpy_helper.from_array(w, "wq"),
        numpy_helper.from_array(rng.uniform(0.001, 0.01, 24).astype(np.float32), "sw"),
        numpy_helper.from_array(np.zeros(24, np.int8), "zw"),
        numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=1),
        helper.make_node("MatMul", ["xdq", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["y"]),
    ]
    g = helper.make_graph(nodes, "qdq_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 24])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_qdq_matmul_bias_relu_becomes_one_int8_layer():
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    _, after = check_pass(fuse_qdq, _qdq_mlp(), {"x": x}, atol=1e-4)
    assert ops(after) == ["kiln::QGemm"]
    assert after.initializers[after.nodes[0].inputs[1]].dtype == torch.int8


def test_int8_engine_matches_onnxruntime_on_the_qdq_model():
    model = _qdq_mlp()
    x = np.random.default_rng(2).standard_normal((7, 16)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 16), (4, 16), (8, 16))})]))
    assert [n.op_type for n in engine.graph.nodes] == ["QGemm"]
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_point", [3, -128])
def test_an_int8_zero_point_joins_the_bias_and_the_layer_reads_the_codes(zero_point):
    model = _qdq_mlp(zero_point=zero_point)
    x = np.random.default_rng(3).standard_normal((7, 16)).astype(np.float32) * 2
    _, after = check_pass(fuse_qdq, model, {"x": x}, atol=1e-4)
    assert ops(after) == ["QuantizeLinear", "kiln::QGemm"]  # Q writes the codes, the layer reads them
    q, layer = after.nodes
    assert layer.inputs[0] == q.outputs[0] and layer.attrs["x_quantized"] == 1
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 16), (7, 16), (8, 16))})]))
    assert [n.op_type for n in engine.graph.nodes] == ["QuantizeLinear", "QGemm"]
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_point", [0, 128, 200])
def test_a_uint8_activation_runs_as_the_int8_pair_it_equals(zero_point):
    model = _qdq_mlp()
    zx = next(i for i in model.graph.initializer if i.name == "zx")
    zx.CopyFrom(numpy_helper.from_array(np.uint8(zero_point), "zx"))
    x = np.random.default_rng(3).standard_normal((7, 16)).astype(np.float32) * 3
    _, after = check_pass(fuse_qdq, model, {"x": x}, atol=1e-4)
    # z = 128 is symmetric once shifted: the layer quantizes x itself; otherwise Q writes the codes
    assert ops(after) == (["kiln::QGemm"] if zero_point == 128 else ["QuantizeLinear", "kiln::QGemm"])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 16), (7, 16), (8, 16))})]))
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


def test_a_uint16_activation_is_left_in_float_and_reported():
    model = _qdq_mlp()
    zx = next(i for i in model.graph.initializer if i.name == "zx")
    zx.CopyFrom(numpy_helper.from_array(np.uint16(0), "zx"))
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    _, after = check_pass(fuse_qdq, model, {"x": x}, atol=1e-4)
    assert "kiln::QGemm" not in ops(after)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 16), (2, 16), (8, 16))})]))
    assert any("uint16" in f.get("reason", "") for f in engine.findings), engine.findings


@pytest.mark.parametrize("narrow", [TensorProto.INT4, TensorProto.UINT4])
def test_4_bit_activations_in_an_8_bit_carrier_are_not_taken_for_8_bit_ones(narrow):
    """An INT4/UINT4 zero point arrives as int8/uint8 with the Q's output_dtype saying 4 bits: quantizing to
    the 8-bit range instead would change the model."""
    model = _qdq_mlp()
    model.opset_import[0].version = 21
    zx = next(i for i in model.graph.initializer if i.name == "zx")
    zx.CopyFrom(helper.make_tensor("zx", narrow, [], [0 if narrow == TensorProto.INT4 else 8]))
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32) * 3
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 16), (4, 16), (8, 16))})]))
    assert "QGemm" not in [n.op_type for n in engine.graph.nodes]
    assert any("int4" in f.get("reason", "") for f in engine.findings), engine.findings
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


def test_an_activation_times_an_activation_stays_float_and_says_why():
    inits = [numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.int8(0), "z")]
    nodes = [helper.make_node("QuantizeLinear", [v, "s", "z"], [f"{v}q"]) for v in ("a", "b")]
    nodes += [helper.make_node("DequantizeLinear", [f"{v}q", "s", "z"], [f"{v}dq"]) for v in ("a", "b")]
    nodes.append(helper.make_node("MatMul", ["adq", "bdq"], ["y"]))
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in
          (("a", [2, 4, 8]), ("b", [2, 8, 4]), ("y", [2, 4, 4]))]
    g = helper.make_graph(nodes, "scores", io[:2], io[2:], inits)
    engine = kiln.build(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
                        kiln.BuildConfig(device="cpu", progress=False))
    assert "QGemm" not in [n.op_type for n in engine.graph.nodes]
    assert any("computed, not a weight" in f.get("reason", "") for f in engine.findings), engine.findings


def test_int8_tactic_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    w_q = torch.randint(-127, 128, (64, 16), generator=g, dtype=torch.int8)
    sx, sw, b = torch.tensor(0.03), torch.rand(16, generator=g) * 0.01, torch.randn(16, generator=g)
    node = Node("QGemm", ["x", "w", "sx", "sw", "b"], ["y"], {"activation": "Relu"}, domain="kiln")
    want = kiln.ops.lookup("QGemm", "kiln").impl(node, x, w_q, sx, sw, b)
    torch.testing.assert_close(int8_int_mm(node, x, w_q, sx, sw, b), want, rtol=1e-5, atol=1e-5)


def _qdq_conv_inits(rng, weight_shape):
    """sx/zx for the activation's Q/DQ, int8 weights wq with per-channel sw/zw, bias b."""
    oc = weight_shape[0]
    return [
        numpy_helper.from_array(np.float32(0.04), "sx"), numpy_helper.from_array(np.int8(0), "zx"),
        numpy_helper.from_array(rng.integers(-127, 128, weight_shape).astype(np.int8), "wq"),
        numpy_helper.from_array(rng.uniform(0.001, 0.01, oc).astype(np.float32), "sw"),
        numpy_helper.from_array(np.zeros(oc, np.int8), "zw"),
        numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b"),
    ]


def test_qdq_conv_matches_onnxruntime():
    rng = np.random.default_rng(4)
    inits = _qdq_conv_inits(rng, (8, 3, 3, 3))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=0),
        helper.make_node("Conv", ["xdq", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    g = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 7, 9])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = rng.standard_normal((1, 3, 7, 9)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    assert [n.op_type for n in engine.graph.nodes] == ["QConv"]
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


def _qdq_conv_with_zero_point(pads, zero_point=-5):
    rng = np.random.default_rng(4)
    inits = _qdq_conv_inits(rng, (8, 3, 3, 3))
    inits[1] = numpy_helper.from_array(np.int8(zero_point), "zx")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=0),
        helper.make_node("Conv", ["xdq", "w", "b"], ["y"], pads=pads),
    ]
    g = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 7, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 1, 1, 1], [2, 0, 1, 3]])
def test_a_conv_with_an_activation_zero_point_runs_int8_its_padding_the_zero_point(pads):
    x = np.random.default_rng(5).standard_normal((2, 3, 7, 9)).astype(np.float32)
    model = _qdq_conv_with_zero_point(pads)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    want = ["QuantizeLinear"] + (["Pad"] if any(pads) else []) + ["QConv"]
    assert [n.op_type for n in engine.graph.nodes] == want
    assert engine.graph.nodes[-1].attrs["pads"] == [0, 0, 0, 0]  # the codes arrive padded with the zero point
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref[0], rtol=1e-5, atol=1e-5)


def test_dequantized_fallback_tactics_match_the_reference():
    from kiln.tactics.library import dequantized_conv, dequantized_gemm

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=g), torch.randint(-127, 128, (64, 16), generator=g, dtype=torch.int8)
    sx, sw, b = torch.tensor(0.03), torch.rand(16, generator=g) * 0.01, torch.randn(16, generator=g)
    node = Node("QGemm", [], [], {"activation": "Relu"}, domain="kiln")
    want = kiln.ops.lookup("QGemm", "kiln").impl(node, x, w, sx, sw, b)
    torch.testing.assert_close(dequantized_gemm(node, x, w, sx, sw, b), want, rtol=1e-5, atol=1e-5)
    xc, wc = torch.randn(1, 3, 7, 9, generator=g), torch.randint(-127, 128, (8, 3, 3, 3), generator=g, dtype=torch.int8)
    conv = Node("QConv", [], [], {"activation": "", "pads": [1, 1, 1, 1]}, domain="kiln")
    swc = torch.rand(8, generator=g) * 0.01
    want = kiln.ops.lookup("QConv", "kiln").impl(conv, xc, wc, sx, swc, None)
    torch.testing.assert_close(dequantized_conv(conv, xc, wc, sx, swc, None), want, rtol=1e-5, atol=1e-5)
    conv.attrs["activation"] = "Relu"  # with the fused residual
    z = torch.randn(1, 8, 7, 9, generator=g)
    want = kiln.ops.lookup("QConv", "kiln").impl(conv, xc, wc, sx, swc, None, z)
    torch.testing.assert_close(dequantized_conv(conv, xc, wc, sx, swc, None, z), want, rtol=1e-5, atol=1e-5)


def _qdq_conv_block(shortcut_const=False):
    """x -> Q/DQ -> Conv(int8 weights, bias) -> Add(shortcut) -> Relu: a ResNet block's last conv and its shortcut."""
    rng = np.random.default_rng(5)
    inits = _qdq_conv_inits(rng, (6, 6, 1, 1))
    if shortcut_const:
        inits.append(numpy_helper.from_array(rng.standard_normal((1, 6, 1, 1)).astype(np.float32), "s"))
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),  # the shortcut: a tensor computed before the conv
        helper.make_node("QuantizeLinear", ["r", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=0),
        helper.make_node("Conv", ["xdq", "w", "b"], ["c"]),
        helper.make_node("Add", ["c", "s" if shortcut_const else "x"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["y"]),
    ]
    g = helper.make_graph(nodes, "qdq_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 5, 7])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 5, 7])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_conv_residual_add_relu_becomes_one_qconv_with_a_residual_input():
    x = np.random.default_rng(6).standard_normal((2, 6, 5, 7)).astype(np.float32)
    before, after = check_pass(fuse_qdq, _qdq_conv_block(), {"x": x}, atol=1e-5)
    assert ops(before) == ["Relu", "QuantizeLinear", "DequantizeLinear", "DequantizeLinear", "Conv", "Add", "Relu"]
    assert ops(after) == ["Relu", "kiln::QConv"]
    q = after.nodes[1]
    assert q.inputs[0] == "r" and q.inputs[4] == "b" and q.inputs[5] == "x"  # x, w_q, sx, sw, bias, residual
    assert q.attr("activation") == "Relu" and q.outputs == ["y"]
    model = _qdq_conv_block()
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    assert [n.op_type for n in engine.graph.nodes] == ["Relu", "QConv"]
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


def test_conv_plus_a_constant_is_not_a_residual():
    x = np.random.default_rng(7).standard_normal((2, 6, 5, 7)).astype(np.float32)
    _, after = check_pass(fuse_qdq, _qdq_conv_block(shortcut_const=True), {"x": x}, atol=1e-5)
    assert ops(after) == ["Relu", "kiln::QConv", "Add", "Relu"] and len(after.nodes[1].inputs) == 5


def test_a_qdq_pair_read_by_two_convolutions_feeds_both():
    # onnxruntime's quantizer shares one activation Q/DQ between convolutions reading the same tensor
    # (ResNet's downsample shortcut and main branch).
    w = np.random.default_rng(0).integers(-100, 100, (4, 3, 1, 1)).astype(np.int8)
    m = model([
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w1", "sw", "zw"], ["w1d"], axis=0),
        helper.make_node("DequantizeLinear", ["w2", "sw", "zw"], ["w2d"], axis=0),
        helper.make_node("Conv", ["xd", "w1d"], ["a"]),
        helper.make_node("Conv", ["xd", "w2d"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ], [("x", [1, 3, 4, 4])], [("y", [1, 4, 4, 4])],
        {"sx": np.float32(0.02), "zx": np.int8(0), "w1": w, "w2": -w, "sw": np.full(4, 0.01, np.float32),
         "zw": np.zeros(4, np.int8)})
    _, after = check_pass(fuse_qdq, m, {"x": rand(1, 3, 4, 4)})
    assert ops(after).count("kiln::QConv") == 2


# --- FP8 E4M3 (ModelOpt's FP8 Q/DQ) and the findings of patterns that stay float ---------------------------

def _fp8(name, values):
    codes = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.float8_e4m3fn)
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(values.shape),
                              codes.view(torch.uint8).numpy().tobytes(), raw=True)


def _fp8_layer(op, weight_form, *, wtype=TensorProto.FLOAT8E4M3FN, act="fp8", axis=None, weight_zero=0):
    """x -> Q/DQ (act: 'fp8', 'int8' or None) -> op on per-channel FP8 weights -> y, at opset 19.
    weight_form: 'codes' (an FP8 initializer read by DequantizeLinear, as ModelOpt's exporter leaves FP8
    weights), 'quantized' (a float weight through QuantizeLinear(FP8) -> DequantizeLinear) or 'float'."""
    rng = np.random.default_rng(5)
    shape, w_axis = {"MatMul": ((16, 24), 1), "Gemm": ((24, 16), 0), "Conv": ((8, 4, 3, 3), 0)}[op]
    w = rng.standard_normal(shape).astype(np.float32)
    scale = (np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != w_axis)) / 448).astype(np.float32)
    bshape = [1] * w.ndim
    bshape[w_axis] = -1
    axis = w_axis if axis is None else axis
    oc = scale.size
    zero = [helper.make_tensor("zw", wtype, [oc], [weight_zero] * oc)]
    inits = [numpy_helper.from_array(scale, "sw"), numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b")]
    nodes = []
    x = "x"
    if act:
        ztype = TensorProto.FLOAT8E4M3FN if act == "fp8" else TensorProto.INT8
        inits += [numpy_helper.from_array(np.float32(0.02), "sx"), helper.make_tensor("zx", ztype, [], [0])]
        nodes += [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
                  helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xdq"])]
        x = "xdq"
    if weight_form == "codes":
        if wtype == TensorProto.FLOAT8E4M3FN:
            inits.append(_fp8("wq", w / scale.reshape(bshape)))
        else:
            inits.append(helper.make_tensor("wq", wtype, list(w.shape),
                                            torch.from_numpy(w / scale.reshape(bshape)).to(torch.float8_e5m2)
                                            .view(torch.uint8).numpy().tobytes(), raw=True))
        inits += zero
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=axis))
    elif weight_form == "quantized":
        inits += [numpy_helper.from_array(w, "wf")] + zero
        nodes += [helper.make_node("QuantizeLinear", ["wf", "sw", "zw"], ["wq"], axis=axis),
                  helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["w"], axis=axis)]
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    if op == "MatMul":
        nodes += [helper.make_node("MatMul", [x, "w"], ["h"], name="layer"), helper.make_node("Add", ["h", "b"], ["y"])]
        io = (["N", 16], ["N", 24])
    elif op == "Gemm":
        nodes.append(helper.make_node("Gemm", [x, "w", "b"], ["y"], transB=1, name="layer"))
        io = (["N", 16], ["N", 24])
    else:
        nodes.append(helper.make_node("Conv", [x, "w", "b"], ["y"], pads=[1, 1, 1, 1], name="layer"))
        io = (["N", 4, 6, 6], ["N", 8, 6, 6])
    g = helper.make_graph(nodes, "fp8_layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, io[0])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, io[1])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _fp8_input(op):
    return np.random.default_rng(6).standard_normal((3, 16) if op != "Conv" else (3, 4, 6, 6)).astype(np.float32)


def _build(m, x):
    shape = tuple(x.shape)
    return kiln.build(m, kiln.BuildConfig(device="cpu", progress=False,
                                          profiles=[kiln.Profile({"x": ((1, *shape[1:]), shape, shape)})]))


def _ort(m, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "Conv"])
@pytest.mark.parametrize("weight_form", ["codes", "quantized"])
def test_fp8_weights_with_per_channel_scales_fuse_into_one_fp8_layer_matching_onnxruntime(op, weight_form):
    m = _fp8_layer(op, weight_form)
    x = _fp8_input(op)
    engine = _build(m, x)
    assert [(n.op_type, n.precision) for n in engine.graph.nodes] == [("QConv" if op == "Conv" else "QGemm", "fp8")]
    assert engine.findings == []
    layer = engine.graph.nodes[0]
    assert engine.graph.initializers[layer.inputs[1]].dtype == torch.float8_e4m3fn
    assert engine.graph.initializers[layer.inputs[3]].numel() == (8 if op == "Conv" else 24)  # per channel
    want = _ort(m, x)
    got = engine.create_execution_context().run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_kiln_inspect_of_an_fp8_qdq_model_shows_fp8_layers_and_no_float_fallback(tmp_path):
    path = tmp_path / "fp8.onnx"
    onnx.save(_fp8_layer("Conv", "codes"), str(path))
    engine = tmp_path / "fp8.kiln"
    assert main(["build", f"--onnx={path}", f"--saveEngine={engine}", "--shapes=x:2x4x6x6",
                 "--skipInference", "--device=cpu"]) == 0
    p = subprocess.run([sys.executable, "-m", "kiln", "inspect", str(engine)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "fp8" in p.stdout and "fusion not applied" not in p.stdout and "runs in float" not in p.stdout, p.stdout


@pytest.mark.parametrize("change, reason", [
    ({"weight_zero": 3}, "the weight's zero point is not 0"),
    ({"axis": 0}, "scales run along axis 0, not along its output channels (axis 1)"),
    ({"wtype": TensorProto.FLOAT8E5M2}, "the weight is quantized as float8_e5m2"),
    ({"act": None}, "its weight is quantized (fp8) but its input is not"),
    ({"act": "int8"}, "its input is quantized as int8 and its weight as fp8"),
    ({"weight_form": "float"}, "its weight is a float constant with no DequantizeLinear"),
])
def test_a_qdq_pattern_that_cannot_run_in_8_bits_runs_in_float_and_the_finding_says_why(change, reason):
    kw = {"weight_form": "codes", **change}
    form = kw.pop("weight_form")
    if change == {"axis": 0}:  # MatMul weights [K, N]: the output channels are axis 1; give K scales along 0
        m = _fp8_layer("MatMul", form, **kw)
        sw = next(i for i in m.graph.initializer if i.name == "sw")
        sw.CopyFrom(numpy_helper.from_array(np.full(16, 0.01, np.float32), "sw"))
        zw = next(i for i in m.graph.initializer if i.name == "zw")
        zw.CopyFrom(helper.make_tensor("zw", TensorProto.FLOAT8E4M3FN, [16], [0] * 16))
    else:
        m = _fp8_layer("MatMul", form, **kw)
    x = _fp8_input("MatMul")
    engine = _build(m, x)
    assert "QGemm" not in [n.op_type for n in engine.graph.nodes]
    found = [f for f in engine.findings if f.get("kind") == "fusion-missed"]
    assert len(found) == 1 and found[0]["nodes"] == ["layer"], engine.findings
    assert reason in found[0]["reason"] and found[0]["reason"].endswith("the layer runs in float"), found[0]
    assert "int8 constants" not in found[0]["reason"]
    if change.get("wtype") != TensorProto.FLOAT8E5M2 and "weight_zero" not in change:  # ORT's CPU kernels
        want = _ort(m, x)
        got = engine.create_execution_context().run({"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
