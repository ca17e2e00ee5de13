"""Hand tests for elementwise.py: legacy broadcasting, wide unsigned types, integer
semantics, old-opset attributes and restrictions that ONNX's node cases leave out.

References are numpy or onnxruntime.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import UnsupportedError

_TYPES = {np.dtype(n): helper.np_dtype_to_tensor_dtype(np.dtype(n)) for n in
          ("float32", "float16", "int8", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")}


def _model(op, feeds, opset=17, out_type=None, **attrs):
    node = helper.make_node(op, list(feeds), ["y"], name=f"{op.lower()}_under_test", **attrs)
    first = next(iter(feeds.values()))
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, _TYPES[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", out_type or _TYPES[first.dtype], None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(op, feeds, opset=17, out_type=None, **attrs):
    model = _model(op, feeds, opset, out_type, **attrs)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    return engine.create_execution_context().run(feeds)["y"]


def test_legacy_broadcast_at_axis():
    # Opset 6: B of shape (3,) is aligned with A's axis 1, not numpy-style with the last axis.
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.array([10, 20, 30], dtype=np.float32)
    got = _run("Add", {"a": a, "b": b}, opset=6, broadcast=1, axis=1)
    np.testing.assert_array_equal(got, a + b.reshape(1, 3, 1))


def test_legacy_broadcast_trailing_default():
    a = np.ones((2, 3, 4), np.float32)
    b = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(_run("Mul", {"a": a, "b": b}, opset=6, broadcast=1), a * b)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_wide_unsigned_arithmetic_and_comparison(dtype):
    a = np.array([0, 5, 9, 65535], dtype=dtype)
    b = np.array([1, 7, 2, 3], dtype=dtype)
    np.testing.assert_array_equal(_run("Sub", {"a": a, "b": b}), a - b)  # wraps around below 0
    np.testing.assert_array_equal(_run("Max", {"a": a, "b": b}), np.maximum(a, b))
    np.testing.assert_array_equal(_run("Mod", {"a": a, "b": b}), np.mod(a, b))
    np.testing.assert_array_equal(_run("Greater", {"a": a, "b": b}, out_type=TensorProto.BOOL), a > b)
    cond = np.array([True, False, True, False])
    np.testing.assert_array_equal(_run("Where", {"c": cond, "a": a, "b": b}, out_type=_TYPES[a.dtype]),
                                  np.where(cond, a, b))


def test_integer_div_truncates_and_mod_follows_divisor_sign():
    a = np.array([7, -7, 7, -7], np.int32)
    b = np.array([2, 2, -2, -2], np.int32)
    np.testing.assert_array_equal(_run("Div", {"a": a, "b": b}), np.trunc(a / b).astype(np.int32))
    np.testing.assert_array_equal(_run("Mod", {"a": a, "b": b}), np.mod(a, b))
    np.testing.assert_array_equal(_run("Mod", {"a": a, "b": b}, fmod=1), np.fmod(a, b))


def test_pow_keeps_base_type():
    x = np.array([1, 2, 3], np.int32)
    e = np.array([0.5, 2.0, 2.5], np.float32)
    got = _run("Pow", {"x": x, "e": e})  # not "y": that names the output
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.power(x, e).astype(np.int32))


def test_clip_opset6_attributes_and_int_one_sided():
    x = np.linspace(-3, 3, 13, dtype=np.float32)
    np.testing.assert_array_equal(_run("Clip", {"x": x}, opset=6, min=-1.0, max=2.0), np.clip(x, -1, 2))
    np.testing.assert_array_equal(_run("Clip", {"x": x}, opset=6), x)
    xi = np.array([-5, 0, 5, 100], np.int32)
    model = _model("Clip", {"x": xi}, opset=13)
    model.graph.node[0].input[:] = ["x", "", "hi"]
    model.graph.initializer.append(helper.make_tensor("hi", TensorProto.INT32, [], [4]))
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    np.testing.assert_array_equal(engine.create_execution_context().run({"x": xi})["y"], np.minimum(xi, 4))


def test_bitshift_uint32_left_wraps():
    x = np.array([1, 3, 0x80000000], np.uint32)
    s = np.array([31, 4, 1], np.uint32)
    np.testing.assert_array_equal(_run("BitShift", {"x": x, "s": s}, direction="LEFT"), x << s)
    np.testing.assert_array_equal(_run("BitShift", {"x": x, "s": s}, direction="RIGHT"), x >> s)


@pytest.mark.filterwarnings("ignore:input 'x' contains NaN")
def test_isinf_detect_flags():
    x = np.array([-np.inf, 0.0, np.inf, np.nan], np.float32)
    got = _run("IsInf", {"x": x}, out_type=TensorProto.BOOL, detect_negative=0)
    np.testing.assert_array_equal(got, [False, False, True, False])


def test_fp16_build_matches_onnxruntime():
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((4, 8)).astype(np.float32), "b": rng.standard_normal((8,)).astype(np.float32)}
    model = _model("Div", feeds)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, fp16=True))
    got = engine.create_execution_context().run(feeds)["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.dtype == np.float32  # the engine keeps the model's output type
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op, attrs, reason", [
    ("Mod", {"fmod": 2}, "fmod=2"),
    ("BitShift", {"direction": "UP"}, "direction='UP'"),
])
def test_restrictions_are_reported_with_the_node_name(op, attrs, reason):
    x = np.array([1, 2], np.uint8)
    with pytest.raises(UnsupportedError, match=rf"{op.lower()}_under_test.*{reason}"):
        kiln.build(_model(op, {"a": x, "b": x}, **attrs), kiln.BuildConfig(device="cpu", progress=False))
