"""Hand tests for nn.py: geometry ONNX's node cases leave out, integer and FP16 paths, restrictions.

References are onnxruntime (same ONNX semantics) or plain numpy.
"""

import numpy as np
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from kiln.errors import UnsupportedError

from .util import run_kiln as _kiln
from .util import run_ort as _ort
from .util import single_op_model as _model


def _against_ort(op, feeds, n_out=1, opset=22, rtol=1e-5, atol=1e-5, **attrs):
    model = _model(op, feeds, [f"y{i}" for i in range(n_out)], opset, **attrs)
    got, want = _kiln(model, feeds), _ort(model, feeds)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return got


rng = np.random.default_rng(0)


def _randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_conv_asymmetric_pads_groups_dilations():
    feeds = {"x": _randn(2, 4, 9, 8), "w": _randn(6, 2, 3, 2), "b": _randn(6)}
    _against_ort("Conv", feeds, group=2, dilations=[2, 1], strides=[2, 3], pads=[0, 2, 3, 1])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad_1d_and_3d(auto_pad):
    _against_ort("Conv", {"x": _randn(1, 2, 10), "w": _randn(3, 2, 4)}, auto_pad=auto_pad, strides=[3])
    _against_ort("Conv", {"x": _randn(1, 2, 5, 6, 7), "w": _randn(2, 2, 2, 3, 2)}, auto_pad=auto_pad,
                 strides=[2, 1, 2])


def test_conv_transpose_general_path():
    # Unequal pads and output_padding >= stride is outside what torch's conv_transpose takes directly.
    feeds = {"x": _randn(1, 4, 5, 4), "w": _randn(4, 3, 3, 3), "b": _randn(6)}
    _against_ort("ConvTranspose", feeds, group=2, strides=[2, 2], dilations=[2, 1], pads=[0, 1, 2, 0],
                 output_padding=[1, 1])


def test_conv_transpose_output_shape_same_lower():
    feeds = {"x": _randn(1, 2, 4, 5), "w": _randn(2, 3, 3, 3)}
    _against_ort("ConvTranspose", feeds, strides=[2, 2], auto_pad="SAME_LOWER")
    _against_ort("ConvTranspose", feeds, strides=[2, 2], output_shape=[9, 12])  # grows: zeros plus bias
    _against_ort("ConvTranspose", feeds, strides=[2, 2], output_shape=[7, 10])  # shrinks: crops both ends


@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_max_pool_indices_with_pads(ceil_mode):
    # pads larger than half the kernel force the explicit-padding path; indices must ignore the padding.
    x = _randn(2, 3, 7, 6)
    model = _model("MaxPool", {"x": x}, ("y0", "y1"), out_types=[TensorProto.FLOAT, TensorProto.INT64],
                   kernel_shape=[2, 3], strides=[2, 2], pads=[1, 2, 0, 1], ceil_mode=ceil_mode)
    (y, idx), (wy, widx) = _kiln(model, {"x": x}), _ort(model, {"x": x})
    np.testing.assert_array_equal(y, wy)
    np.testing.assert_array_equal(idx, widx)
    np.testing.assert_array_equal(x.reshape(-1)[idx], y)


def test_max_pool_indices_storage_order_column_major():
    x = _randn(1, 2, 6, 5)
    model = _model("MaxPool", {"x": x}, ("y0", "y1"), out_types=[TensorProto.FLOAT, TensorProto.INT64],
                   kernel_shape=[3, 2], strides=[2, 2], storage_order=1)
    (_, idx), (_, widx) = _kiln(model, {"x": x}), _ort(model, {"x": x})
    np.testing.assert_array_equal(idx, widx)


def test_max_pool_int_with_padding_never_selects_pad():
    x = rng.integers(-100, -50, size=(1, 1, 5, 5)).astype(np.int32)
    model = _model("MaxPool", {"x": x}, opset=22, kernel_shape=[3, 3], pads=[2, 2, 2, 2])
    (y,) = _kiln(model, {"x": x})
    assert y.dtype == np.int32 and y.shape == (1, 1, 7, 7)
    assert y.max() < -49  # the padding value is the type's minimum, not 0


@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_dilated_asymmetric(include_pad):
    _against_ort("AveragePool", {"x": _randn(1, 2, 9, 8)}, kernel_shape=[3, 2], strides=[2, 1],
                 dilations=[2, 3], pads=[1, 0, 2, 1], count_include_pad=include_pad)


def test_global_lp_pool():
    _against_ort("GlobalLpPool", {"x": _randn(2, 3, 4, 5)}, opset=12, p=3, rtol=1e-4)


def test_lp_pool_fp16_does_not_overflow():
    # 20**4 * 4 = 640000 overflows FP16 (max 65504); LpPool sums its powers in FP32.
    x = np.full((1, 1, 4, 4), 20.0, dtype=np.float32)
    model = _model("LpPool", {"x": x}, kernel_shape=[2, 2], p=4)
    (y,) = _kiln(model, {"x": x}, fp16=True)
    np.testing.assert_allclose(y.astype(np.float32), np.full((1, 1, 3, 3), 20.0 * 4 ** 0.25), rtol=1e-3)


def test_lrn_even_size():
    # torch's local_response_norm centres even windows differently from ONNX; onnxruntime refuses
    # even sizes, so the reference is the spec's formula: channels [c - 1, c + 2] for size 4.
    x = _randn(2, 6, 3, 3)
    (y,) = _kiln(_model("LRN", {"x": x}, opset=13, size=4, alpha=0.5, beta=0.75, bias=1.5), {"x": x})
    sq = np.stack([(x[:, max(0, c - 1):c + 3] ** 2).sum(1) for c in range(6)], axis=1)
    np.testing.assert_allclose(y, x / (1.5 + 0.5 / 4 * sq) ** 0.75, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint32"])
def test_matmul_integer_types(dtype):
    a = rng.integers(0, 50, size=(2, 3, 4)).astype(dtype)
    b = rng.integers(0, 50, size=(4, 5)).astype(dtype)
    (y,) = _kiln(_model("MatMul", {"a": a, "b": b}, opset=13), {"a": a, "b": b})
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, a @ b)


def test_gemm_integer_and_column_bias():
    a = rng.integers(-9, 9, size=(4, 3)).astype(np.int64)
    b = rng.integers(-9, 9, size=(5, 3)).astype(np.int64)
    c = rng.integers(-9, 9, size=(4, 1)).astype(np.int64)
    feeds = {"a": a, "b": b, "c": c}
    (y,) = _kiln(_model("Gemm", feeds, opset=13, transB=1), feeds)
    np.testing.assert_array_equal(y, a @ b.T + c)
    f = {k: v.astype(np.float32) for k, v in feeds.items()}
    _against_ort("Gemm", f, opset=13, transB=1, alpha=0.5, beta=2.0)


def test_einsum_ellipsis_broadcast():
    _against_ort("Einsum", {"a": _randn(2, 3, 4), "b": _randn(3, 4, 5)}, equation="...ij,ijk->...k", opset=12,
                 rtol=1e-4)


def test_unsupported_geometry_is_reported_with_node_name():
    x = _randn(1, 1, 2, 2, 2, 2)
    model = _model("MaxPool", {"x": x}, kernel_shape=[1, 1, 1, 1])
    with pytest.raises(UnsupportedError, match="maxpool_under_test.*4-D MaxPool"):
        _kiln(model, {"x": x})
    model = _model("Conv", {"x": _randn(1, 1, 4), "w": _randn(1, 1, 2)}, auto_pad="SAME")
    with pytest.raises(UnsupportedError, match="conv_under_test.*auto_pad 'SAME'"):
        _kiln(model, {})


def test_deform_conv_groups_strides_mask():
    # ONNX's cases use one group and no stride/dilation; onnx's reference evaluator covers the rest.
    feeds = {"x": _randn(2, 4, 6, 5), "w": _randn(6, 2, 2, 3), "offset": _randn(2, 2 * 2 * 6, 3, 2),
             "b": _randn(6), "mask": rng.random((2, 2 * 6, 3, 2)).astype(np.float32)}
    model = _model("DeformConv", feeds, opset=19, group=2, offset_group=2, strides=[2, 2], dilations=[2, 1],
                   pads=[1, 0, 0, 1])
    (y,) = _kiln(model, feeds)
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_deform_conv_zero_offsets_is_conv():
    x, w = _randn(1, 3, 7, 7), _randn(4, 3, 3, 3)
    offset = np.zeros((1, 18, 3, 3), dtype=np.float32)
    (y,) = _kiln(_model("DeformConv", {"x": x, "w": w, "offset": offset}, opset=19, strides=[2, 2]),
                 {"x": x, "w": w, "offset": offset})
    (want,) = _kiln(_model("Conv", {"x": x, "w": w}, strides=[2, 2]), {"x": x, "w": w})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_einsum_integer():
    a = rng.integers(-20, 20, size=(3, 4)).astype(np.int64)
    b = rng.integers(-20, 20, size=(4, 2)).astype(np.int64)
    (y,) = _kiln(_model("Einsum", {"a": a, "b": b}, opset=12, equation="ij,jk->ki"), {"a": a, "b": b})
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, (a @ b).T)


def test_max_unpool_inverts_max_pool_to_output_shape():
    """MaxPool (5x5 -> 2x2, indices) then MaxUnpool back to 5x5: indices address output_shape, as in
    onnxruntime and PyTorch's max_unpool2d."""
    import torch
    from onnx import helper

    x = _randn(2, 3, 5, 5)
    nodes = [helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxUnpool", ["p", "i", "s"], ["y"], name="unpool", kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("s", TensorProto.INT64, [4], list(x.shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=11)
    (got,) = _kiln(model, {"x": x})
    np.testing.assert_array_equal(got, _ort(model, {"x": x})[0])
    pooled, idx = torch.nn.functional.max_pool2d(torch.from_numpy(x), 2, 2, return_indices=True)
    np.testing.assert_array_equal(got, torch.nn.functional.max_unpool2d(pooled, idx, 2, 2, output_size=(5, 5)))


def test_det_batched_and_fp16():
    from onnx import helper

    x = _randn(4, 3, 3)
    got = _against_ort("Det", {"x": x}, rtol=1e-4, atol=1e-5)[0]
    assert got.shape == (4,)
    h = x.astype(np.float16)
    node = helper.make_node("Det", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, h.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=11)
    (got16,) = _kiln(model, {"x": h})  # torch has no FP16 LU: factored in FP32, rounded once
    np.testing.assert_allclose(got16.astype(np.float32), np.linalg.det(h.astype(np.float32)), rtol=2e-3, atol=2e-3)


def test_causal_conv_with_state_streams_like_one_pass():
    """Two chunks with the carried state give the one-pass result (SiLU fused), which is a left-zero-padded
    depthwise conv1d."""
    import torch
    from onnx import helper

    x, w, b = _randn(2, 4, 7), _randn(4, 1, 3), _randn(4)

    def model(with_state):
        inputs = ["x", "w", "b"] + (["s"] if with_state else [])
        node = helper.make_node("CausalConvWithState", inputs, ["y", "state"], activation="silu")
        vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, None]),
               helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 1, 3]),
               helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])]
        if with_state:
            vis.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 4, 2]))
        outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "state")]
        graph = helper.make_graph([node], "g", vis, outs)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)], ir_version=11)

    whole, state = _kiln(model(False), {"x": x, "w": w, "b": b}, shapes={"x": (2, 4, 7)})
    first, s1 = _kiln(model(False), {"x": x[:, :, :4], "w": w, "b": b}, shapes={"x": (2, 4, 4)})
    second, s2 = _kiln(model(True), {"x": x[:, :, 4:], "w": w, "b": b, "s": s1}, shapes={"x": (2, 4, 3)})
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s2, state)
    np.testing.assert_array_equal(state, x[:, :, -2:])
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.nn.functional.pad(torch.from_numpy(x), (2, 0)), torch.from_numpy(w), torch.from_numpy(b), groups=4))
    np.testing.assert_allclose(whole, ref.numpy(), rtol=1e-5, atol=1e-6)
