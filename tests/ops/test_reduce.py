"""Hand tests for reduce.py: axes as attribute vs input across opsets, no-op
reductions of composite ops, integer paths and FP16 builds (keep_fp32).

References are numpy or onnxruntime.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln

rng = np.random.default_rng(0)


def _model(op, x, opset=18, axes=None, axes_as_input=False, pre=None, **attrs):
    """x -> [pre (Mul by a constant)] -> op -> y; axes as an attribute or an initializer input."""
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    nodes, inits, src = [], [], "x"
    if pre is not None:
        inits.append(helper.make_tensor("k", elem, [], [pre]))
        nodes.append(helper.make_node("Mul", ["x", "k"], ["xm"]))
        src = "xm"
    inputs = [src]
    if axes is not None and axes_as_input:
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes))
        inputs.append("axes")
    elif axes is not None:
        attrs["axes"] = axes
    nodes.append(helper.make_node(op, inputs, ["y"], name=f"{op.lower()}_under_test", **attrs))
    out_elem = TensorProto.INT64 if op.startswith("Arg") else elem
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, x.shape)],
                              [helper.make_tensor_value_info("y", out_elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _kiln(model, x, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return engine, engine.create_execution_context().run({"x": x})["y"]


def _ort(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", _OPS)
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_axes_attribute_or_input_by_opset(op, opset):
    # Axes became an input at opset 13 for ReduceSum and at 18 for the others.
    as_input = opset >= (13 if op == "ReduceSum" else 18)
    x = rng.uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)
    model = _model(op, x, opset, axes=[0, -1], axes_as_input=as_input, keepdims=0)
    _, got = _kiln(model, x)
    np.testing.assert_allclose(got, _ort(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, want", [
    ("ReduceSumSquare", np.square), ("ReduceL1", np.abs), ("ReduceLogSum", np.log),
    ("ReduceL2", np.abs), ("ReduceMax", lambda x: x),
])
def test_noop_with_empty_axes_keeps_the_elementwise_steps(op, want):
    x = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    _, got = _kiln(_model(op, x, 18, noop_with_empty_axes=1), x)
    np.testing.assert_allclose(got, want(x), rtol=1e-6)


@pytest.mark.parametrize("op, fn", [("ReduceSum", np.sum), ("ReduceMax", np.max), ("ReduceProd", np.prod)])
def test_integer_reductions_keep_type(op, fn):
    x = rng.integers(-3, 4, (3, 4)).astype(np.int32)
    _, got = _kiln(_model(op, x, 18, axes=[1], axes_as_input=True, keepdims=1), x)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, fn(x, axis=1, keepdims=True))


def test_argmax_select_last_index_uint32():
    x = np.array([[3, 7, 7, 1], [9, 9, 0, 9]], np.uint32)
    _, got = _kiln(_model("ArgMax", x, 13, axis=1, keepdims=0, select_last_index=1), x)
    np.testing.assert_array_equal(got, [2, 3])


def test_reduce_sum_stays_fp32_in_fp16_build():
    x = np.full((4, 1000), 300.0, np.float32)  # row sums of 300000 overflow FP16
    engine, got = _kiln(_model("ReduceSum", x, 18, axes=[1], axes_as_input=True, keepdims=0), x, fp16=True)
    layer = next(n for n in engine.graph.nodes if n.op_type == "ReduceSum")
    assert layer.precision == "float32" and "FP16" in layer.note
    np.testing.assert_allclose(got, np.full(4, 300000.0), rtol=1e-6)


def test_reduce_l2_of_fp16_input_accumulates_in_fp32():
    # The Mul runs in FP16, so the ReduceL2 receives FP16 values whose squares (90000)
    # overflow FP16 although the norm (1200) does not.
    x = np.full((2, 16), 300.0, np.float32)
    _, got = _kiln(_model("ReduceL2", x, 18, axes=[1], axes_as_input=True, keepdims=0, pre=1.0), x, fp16=True)
    np.testing.assert_allclose(got, [1200.0, 1200.0], rtol=1e-3)


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_fp16_matches_onnxruntime(exclusive, reverse):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    model = _model("CumSum", x, 14, exclusive=exclusive, reverse=reverse)
    model.graph.node[-1].input.append("axis")
    model.graph.initializer.append(helper.make_tensor("axis", TensorProto.INT64, [], [1]))
    _, got = _kiln(model, x, fp16=True)
    np.testing.assert_allclose(got, _ort(model, x), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_modes_on_integers_and_axis_input(exclusive, reverse):
    x = rng.integers(-3, 4, (3, 5)).astype(np.int64)
    model = _model("CumProd", x, opset=26, axes=None, exclusive=exclusive, reverse=reverse)
    axis = helper.make_tensor("axis", TensorProto.INT64, [], [-1])
    model.graph.initializer.append(axis)
    model.graph.node[0].input.append("axis")
    _, got = _kiln(model, x)
    y = np.flip(x, 1) if reverse else x
    want = np.cumprod(y, axis=1)
    if exclusive:
        want = np.concatenate([np.ones_like(want[:, :1]), want[:, :-1]], axis=1)
    np.testing.assert_array_equal(got, np.flip(want, 1) if reverse else want)
