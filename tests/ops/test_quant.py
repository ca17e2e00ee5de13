"""Hand tests for quant.py against the ONNX formulas written out in numpy: per-axis
and blocked Q/DQ, narrow and float8 outputs, precision/output_dtype, FP16
builds, and the integer / QLinear products with per-row and per-channel zero points."""

import ml_dtypes
import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import UnsupportedError
from kiln.ir import dtypes

rng = np.random.default_rng(0)
_NP = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
       np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8,
       np.dtype(np.int16): TensorProto.INT16, np.dtype(np.uint16): TensorProto.UINT16,
       np.dtype(np.int32): TensorProto.INT32}


def _model(op, feeds, out_type, inits=(), opset=21, **attrs):
    """One `op` node; `feeds` (name -> array) become graph inputs, `inits` initializers."""
    names = list(feeds) + [t.name for t in inits]
    node = helper.make_node(op, attrs.pop("inputs", names), ["y"], name="op_under_test", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, _NP[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", out_type, None)], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return dtypes.pin_narrow_types(model)


def _run(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


def _expand(v, shape, axis, block=0):
    """The ONNX layout of a scale/zero point, written out in numpy."""
    if v.size == 1:
        return v.reshape(())
    if block:
        return np.repeat(v, block, axis=axis).take(range(shape[axis]), axis=axis)
    dims = [1] * len(shape)
    dims[axis] = v.size
    return v.reshape(dims)


def _quantize_ref(x, scale, zp, axis, lo, hi, block=0):
    q = np.rint(x / _expand(scale, x.shape, axis, block)) + _expand(zp, x.shape, axis, block)
    return np.clip(q, lo, hi)


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_per_axis_quantize_dequantize(axis):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32) * 3
    n = x.shape[axis]
    scale = rng.uniform(0.01, 0.05, n).astype(np.float32)
    zp = rng.integers(-20, 20, n).astype(np.int8)
    (q,) = _run(_model("QuantizeLinear", {"x": x, "s": scale, "z": zp}, TensorProto.INT8, axis=axis),
                {"x": x, "s": scale, "z": zp})
    np.testing.assert_array_equal(q, _quantize_ref(x, scale, zp, axis % 3, -128, 127))
    (dq,) = _run(_model("DequantizeLinear", {"q": q, "s": scale, "z": zp}, TensorProto.FLOAT, axis=axis),
                 {"q": q, "s": scale, "z": zp})
    want = (q.astype(np.float32) - _expand(zp, x.shape, axis % 3)) * _expand(scale, x.shape, axis % 3)
    np.testing.assert_array_equal(dq, want)


def test_blocked_quantization_with_a_partial_last_block():
    x = rng.standard_normal((3, 10)).astype(np.float32) * 4
    scale = rng.uniform(0.02, 0.1, (3, 3)).astype(np.float32)  # blocks of 4 along axis 1: 4 + 4 + 2
    zp = rng.integers(100, 150, (3, 3)).astype(np.uint8)
    feeds = {"x": x, "s": scale, "z": zp}
    (q,) = _run(_model("QuantizeLinear", feeds, TensorProto.UINT8, axis=1, block_size=4), feeds)
    want = _quantize_ref(x, scale, zp, 1, 0, 255, block=4)
    np.testing.assert_array_equal(q, want)
    assert q[0, 9] == np.clip(np.rint(x[0, 9] / scale[0, 2]) + zp[0, 2], 0, 255)  # the short block's own scale
    feeds = {"q": q, "s": scale, "z": zp}
    (dq,) = _run(_model("DequantizeLinear", feeds, TensorProto.FLOAT, axis=1, block_size=4), feeds)
    np.testing.assert_array_equal(dq, (q - _expand(zp, x.shape, 1, 4).astype(np.float32))
                                  * _expand(scale, x.shape, 1, 4))


@pytest.mark.parametrize("to, lo, hi", [(TensorProto.INT4, -8, 7), (TensorProto.UINT4, 0, 15),
                                        (TensorProto.INT2, -2, 1), (TensorProto.UINT16, 0, 65535)])
def test_narrow_and_wide_integer_outputs_saturate(to, lo, hi):
    """The output type comes from a zero point initializer of that type (INT4 -> [-8, 7]...)."""
    x = np.linspace(-100, 100, 24, dtype=np.float32).reshape(4, 6) * (5000 if to == TensorProto.UINT16 else 1)
    scale = np.array([1.5, 2.0, 3.0, 4.0], np.float32)
    zp = helper.make_tensor("z", to, [4], [1, 0, 1, 0])
    (q,) = _run(_model("QuantizeLinear", {"x": x, "s": scale}, to, inits=[zp], axis=0), {"x": x, "s": scale})
    want = _quantize_ref(x, scale, np.array([1, 0, 1, 0]), 0, lo, hi)
    np.testing.assert_array_equal(q.astype(np.int64), want)
    assert q.min() == lo and q.max() == hi


def test_output_dtype_without_zero_point_and_dequantize_output_dtype():
    x = np.array([-10.0, -0.26, 0.24, 3.0, 100.0], np.float32)
    scale = np.array(0.5, np.float32)
    feeds = {"x": x, "s": scale}
    (q,) = _run(_model("QuantizeLinear", feeds, TensorProto.INT4, output_dtype=TensorProto.INT4, opset=23), feeds)
    assert q.tolist() == [-8, -1, 0, 6, 7]
    feeds = {"q": q, "s": scale}
    (y,) = _run(_model("DequantizeLinear", feeds, TensorProto.FLOAT16, output_dtype=TensorProto.FLOAT16,
                       inputs=["q", "s"], opset=23), feeds)
    assert y.dtype == np.float16 and y.tolist() == [-4.0, -0.5, 0.0, 3.0, 3.5]


def test_float8_quantize_saturate_flag():
    x = np.array([1.0, 500.0, -1e6], np.float32)
    scale = np.array(1.0, np.float32)
    zp = numpy_helper.from_array(np.zeros(1, ml_dtypes.float8_e4m3fn), "z")
    feeds = {"x": x, "s": scale}
    (sat,) = _run(_model("QuantizeLinear", feeds, TensorProto.FLOAT8E4M3FN, inits=[zp]), feeds)
    assert sat.tolist() == [1.0, 448.0, -448.0]
    (raw,) = _run(_model("QuantizeLinear", feeds, TensorProto.FLOAT8E4M3FN, inits=[zp], saturate=0), feeds)
    assert raw[0] == 1.0 and np.isnan(raw[1:]).all()


def test_float4_quantize_dequantize():
    x = np.array([[0.1, 1.3, -2.6, 20.0]], np.float32)
    scale = np.array([0.5], np.float32)
    zp = helper.make_tensor("z", TensorProto.FLOAT4E2M1, [1], [0.0])
    (q,) = _run(_model("QuantizeLinear", {"x": x, "s": scale}, TensorProto.FLOAT4E2M1, inits=[zp], axis=0),
                {"x": x, "s": scale})
    assert q.tolist() == [[0.0, 3.0, -6.0, 6.0]]  # 0.2, 2.6, -5.2, 40 on the E2M1 grid


def test_precision_attribute_sets_division_precision():
    x = np.array([1000.3], np.float32)
    scale = np.array(0.1, np.float16)
    feeds = {"x": x, "s": scale}
    (default,) = _run(_model("QuantizeLinear", feeds, TensorProto.INT16, output_dtype=TensorProto.INT16, opset=23),
                      feeds)
    (fp32,) = _run(_model("QuantizeLinear", feeds, TensorProto.INT16, output_dtype=TensorProto.INT16, opset=23,
                          precision=TensorProto.FLOAT), feeds)
    assert default[0] == int(np.float16(np.float16(x[0]) / scale))  # FP16 division, the scale's type
    assert fp32[0] == np.rint(x[0] / np.float32(scale))


def test_qdq_in_fp16_build_keeps_fp32_scales():
    x = rng.standard_normal(64).astype(np.float32)
    scale = np.array(0.0123457, np.float32)  # not representable in FP16
    zp = np.array(3, np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
                              [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (y16,) = _run(model, {"x": x}, fp16=True)
    want = (_quantize_ref(x, scale, zp, 0, -128, 127) - 3) * scale
    np.testing.assert_array_equal(y16, want.astype(np.float32))


def test_dynamic_quantize_linear_edges():
    model = _model("DynamicQuantizeLinear", {"x": np.zeros(4, np.float32)}, TensorProto.UINT8, opset=11)
    node = model.graph.node[0]
    node.output[:] = ["y", "scale", "zp"]
    model.graph.output.extend([helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("zp", TensorProto.UINT8, [])])
    y, scale, zp = _run(model, {"x": np.zeros(4, np.float32)})
    assert y.tolist() == [0, 0, 0, 0] and scale == np.float32(1 / 255) and zp == 0  # all-zero input
    x = np.array([0.5, 1.0, 2.55, 1.7], np.float32)  # no negatives: the range still starts at 0
    y, scale, zp = _run(model, {"x": x})
    assert zp == 0 and np.isclose(scale, 2.55 / 255) and y.tolist() == list(np.rint(x / scale).astype(int))


def test_matmul_integer_per_row_and_per_column_zero_points():
    a = rng.integers(0, 255, (2, 3, 5)).astype(np.uint8)
    b = rng.integers(-128, 127, (5, 4)).astype(np.int8)
    a_zp = rng.integers(0, 255, 3).astype(np.uint8)  # one per row of a
    b_zp = rng.integers(-10, 10, 4).astype(np.int8)  # one per column of b
    feeds = {"a": a, "b": b, "az": a_zp, "bz": b_zp}
    (y,) = _run(_model("MatMulInteger", feeds, TensorProto.INT32, opset=10), feeds)
    want = (a.astype(np.int64) - a_zp[:, None]) @ (b.astype(np.int64) - b_zp)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, want)


def _conv_ref(x, w, pads):
    """Plain-loop 2-D convolution (stride 1) of int64 arrays, zero padding."""
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    n, _, h, wd = x.shape
    m, _, kh, kw = w.shape
    out = np.zeros((n, m, h - kh + 1, wd - kw + 1), np.int64)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            out[:, :, i, j] = np.einsum("nchw,mchw->nm", x[:, :, i:i + kh, j:j + kw], w)
    return out


def test_conv_integer_pads_with_the_zero_point_and_per_channel_weights():
    x = rng.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    w = rng.integers(0, 255, (3, 2, 2, 2)).astype(np.uint8)
    x_zp = np.array(100, np.uint8)
    w_zp = np.array([120, 128, 135], np.uint8)
    feeds = {"x": x, "w": w, "xz": x_zp, "wz": w_zp}
    (y,) = _run(_model("ConvInteger", feeds, TensorProto.INT32, opset=10, auto_pad="SAME_UPPER"), feeds)
    want = _conv_ref(x.astype(np.int64) - 100, w.astype(np.int64) - w_zp[:, None, None, None], [0, 0, 1, 1])
    np.testing.assert_array_equal(y, want)


def test_qlinear_conv_per_channel_scales_and_bias():
    x = rng.integers(0, 255, (1, 2, 4, 4)).astype(np.uint8)
    w = rng.integers(-127, 127, (3, 2, 3, 3)).astype(np.int8)
    bias = rng.integers(-2000, 2000, 3).astype(np.int32)
    xs, xz = np.array(0.02, np.float32), np.array(128, np.uint8)
    ws, wz = np.array([0.01, 0.005, 0.02], np.float32), np.zeros(3, np.int8)
    ys, yz = np.array(0.15, np.float32), np.array(5, np.int8)
    feeds = {"x": x, "xs": xs, "xz": xz, "w": w, "ws": ws, "wz": wz, "ys": ys, "yz": yz, "b": bias}
    (y,) = _run(_model("QLinearConv", feeds, TensorProto.INT8, opset=10, pads=[1, 1, 1, 1]), feeds)
    acc = _conv_ref(x.astype(np.int64) - 128, w.astype(np.int64), [1, 1, 1, 1]) + bias[None, :, None, None]
    m = (xs * ws / ys).astype(np.float32)[None, :, None, None]
    want = np.clip(np.rint(acc * m.astype(np.float64)) + 5, -128, 127)
    assert y.dtype == np.int8
    np.testing.assert_array_equal(y, want)


def test_qlinear_matmul_per_row_a_and_per_column_b():
    a = rng.integers(0, 255, (3, 4)).astype(np.uint8)
    b = rng.integers(0, 255, (4, 2)).astype(np.uint8)
    a_s, a_z = np.array([0.01, 0.02, 0.03], np.float32), np.array([120, 125, 130], np.uint8)
    b_s, b_z = np.array([0.05, 0.04], np.float32), np.array([127, 100], np.uint8)
    y_s, y_z = np.array(0.5, np.float32), np.array(10, np.uint8)
    feeds = {"a": a, "as": a_s, "az": a_z, "b": b, "bs": b_s, "bz": b_z, "ys": y_s, "yz": y_z}
    (y,) = _run(_model("QLinearMatMul", feeds, TensorProto.UINT8), feeds)
    acc = (a.astype(np.int64) - a_z[:, None]) @ (b.astype(np.int64) - b_z)
    want = np.clip(np.rint(acc * (a_s[:, None] * b_s / y_s).astype(np.float64)) + 10, 0, 255)
    np.testing.assert_array_equal(y, want)


def test_unsupported_quantize_attributes_are_reported():
    feeds = {"x": np.zeros(2, np.float32), "s": np.array(1.0, np.float32)}
    with pytest.raises(UnsupportedError, match="op_under_test.*output_dtype FLOAT"):
        _run(_model("QuantizeLinear", feeds, TensorProto.FLOAT, output_dtype=TensorProto.FLOAT), feeds)
    with pytest.raises(UnsupportedError, match="op_under_test.*output_dtype INT8"):
        _run(_model("DequantizeLinear", {"x": np.zeros(2, np.int8), "s": np.array(1.0, np.float32)},
                    TensorProto.INT8, output_dtype=TensorProto.INT8, opset=23),
             {"x": np.zeros(2, np.int8), "s": np.array(1.0, np.float32)})


def test_int4_weight_dequantizes_from_its_carrier():
    """An INT4 initializer (packed in the file) becomes int8 values; DQ needs nothing else."""
    w = helper.make_tensor("w", TensorProto.INT4, [2, 3], [-8, -1, 0, 1, 5, 7])
    zp = helper.make_tensor("z", TensorProto.INT4, [2], [0, 1])
    scale = np.array([0.5, 2.0], np.float32)
    (y,) = _run(_model("DequantizeLinear", {"s": scale}, TensorProto.FLOAT, inits=[w, zp], axis=0,
                       inputs=["w", "s", "z"]), {"s": scale})
    assert y.tolist() == [[-4.0, -0.5, 0.0], [0.0, 8.0, 12.0]]
    assert torch.equal(dtypes.to_torch(np.array([-8, 7], ml_dtypes.int4)), torch.tensor([-8, 7], dtype=torch.int8))


def test_zero_point_computed_in_the_graph_is_pinned_by_type_inference():
    nodes = [helper.make_node("Cast", ["zf"], ["z"], to=TensorProto.INT4),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT4, None)],
                              [helper.make_tensor("zf", TensorProto.FLOAT, [], [1.0]),
                               helper.make_tensor("s", TensorProto.FLOAT, [], [1.0])])
    model = dtypes.pin_narrow_types(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert helper.get_attribute_value(model.graph.node[1].attribute[0]) == TensorProto.INT4
    (y,) = _run(model, {"x": np.array([-20.0, 0.0, 20.0], np.float32)})
    assert y.tolist() == [-8, 1, 7]
