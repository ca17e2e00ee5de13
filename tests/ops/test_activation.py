"""Hand tests for activation.py: pre-opset-13 Softmax semantics, FP16 Softmax, old
PRelu broadcasting, experimental ops without ONNX node cases, restrictions.

References are numpy or onnxruntime.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import kiln
from kiln.errors import UnsupportedError

rng = np.random.default_rng(0)


def _model(op, feeds, opset=17, **attrs):
    node = helper.make_node(op, list(feeds), ["y"], name=f"{op.lower()}_under_test", **attrs)
    first = next(iter(feeds.values()))
    elem = helper.np_dtype_to_tensor_dtype(first.dtype)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(op, feeds, opset=17, **attrs):
    engine = kiln.build(_model(op, feeds, opset, **attrs), kiln.BuildConfig(device="cpu", progress=False))
    return engine.create_execution_context().run(feeds)["y"]


def _np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset, axis", [(11, None), (11, 0), (11, -1), (13, None), (13, 1)])
def test_softmax_family_axis_semantics_match_onnxruntime(op, opset, axis):
    # Before opset 13 the input is coerced to 2-D at `axis` (default 1).
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    attrs = {} if axis is None else {"axis": axis}
    model = _model(op, {"x": x}, opset, **attrs)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    got = engine.create_execution_context().run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_softmax_opset11_normalizes_over_the_flattened_tail():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    got = _run("Softmax", {"x": x}, opset=11)
    np.testing.assert_allclose(got.reshape(2, 12).sum(axis=1), [1, 1], rtol=1e-6)
    np.testing.assert_allclose(got, _np_softmax(x.reshape(2, 12), 1).reshape(2, 3, 4), rtol=1e-5)


def test_softmax_fp16_rounds_like_onnx_function_body():
    # ONNX defines FP16 Softmax as Exp(x - max) / ReduceSum(...) with FP16 results at each step.
    x = (rng.standard_normal((64, 7)) * 3).astype(np.float16)
    got = _run("Softmax", {"x": x})
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, _np_softmax(x, -1))


def test_prelu_opset6_one_dimensional_slope_is_per_channel():
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    got = _run("PRelu", {"x": x, "slope": slope}, opset=6)
    s = slope.reshape(3, 1, 1)
    np.testing.assert_allclose(got, np.where(x < 0, x * s, x), rtol=1e-6)


def test_relu_and_shrink_on_integers():
    x = np.array([-3, -1, 0, 2, 5], np.int32)
    np.testing.assert_array_equal(_run("Relu", {"x": x}), np.maximum(x, 0))
    got = _run("Shrink", {"x": x}, bias=1.0, lambd=1.5)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [-2, 0, 0, 1, 4])


def test_experimental_ops():
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(_run("ScaledTanh", {"x": x}, opset=9, alpha=2.0, beta=0.5),
                               2 * np.tanh(0.5 * x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_run("ParametricSoftplus", {"x": x}, opset=9, alpha=2.0, beta=0.5),
                               2 * np.log1p(np.exp(0.5 * x)), rtol=1e-5, atol=1e-6)
    bias = [1.0, 2.0, 3.0]
    np.testing.assert_allclose(_run("ImageScaler", {"x": x}, opset=9, scale=0.5, bias=bias),
                               0.5 * x + np.array(bias, np.float32).reshape(1, 3, 1, 1), rtol=1e-6)


def test_gelu_tanh_fp16_build_matches_onnxruntime():
    x = rng.standard_normal((4, 16)).astype(np.float32)
    model = _model("Gelu", {"x": x}, opset=20, approximate="tanh")
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, fp16=True))
    got = engine.create_execution_context().run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_gelu_unknown_approximation_is_reported():
    x = np.zeros((2,), np.float32)
    with pytest.raises(UnsupportedError, match="gelu_under_test.*approximate='erf'"):
        kiln.build(_model("Gelu", {"x": x}, opset=20, approximate="erf"),
                   kiln.BuildConfig(device="cpu", progress=False))


def test_swiglu_alpha_matches_reference_and_formula():
    from onnx.reference import ReferenceEvaluator

    feeds = {"a": rng.standard_normal((2, 8)).astype(np.float32), "b": rng.standard_normal((2, 8)).astype(np.float32)}
    model = _model("SwiGLU", feeds, opset=28, alpha=1.702)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    got = engine.create_execution_context().run(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-6, atol=1e-6)
    a = feeds["a"]
    np.testing.assert_allclose(got, a / (1 + np.exp(-1.702 * a)) * feeds["b"], rtol=1e-5, atol=1e-6)
