"""Hand tests for indexing.py: what ONNX's node cases leave out.

Negative indices on every axis, batch_dims with slices, reductions on integer
and unsigned types, TopK ties, unsorted Unique with an axis, value-dependent
shapes in an engine. References: onnxruntime, ONNX's reference evaluator, or numpy.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import kiln

_TYPES = {np.dtype("float32"): TensorProto.FLOAT, np.dtype("int32"): TensorProto.INT32,
          np.dtype("int64"): TensorProto.INT64, np.dtype("uint32"): TensorProto.UINT32,
          np.dtype("uint64"): TensorProto.UINT64, np.dtype("bool"): TensorProto.BOOL}

rng = np.random.default_rng(0)


def _model(op, feeds, out_types, opset=22, **attrs):
    """One `op` node over graph inputs `feeds`; out_types: one ONNX element type per output."""
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, list(feeds), outs, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, _TYPES[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types)])
    # IR 11 (not onnx's newest) so that older onnxruntime builds load the model too.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def _kiln(model, feeds):
    # No build-time validation run: its random inputs would be out-of-range indices.
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, validate=False))
    return list(engine.create_execution_context().run(feeds).values())


def _check(model, feeds, reference="ort"):
    got = _kiln(model, feeds)
    if reference == "ort":
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    else:
        want = ReferenceEvaluator(model).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    return got


def _same(op, feeds, n_out=1, opset=22, out_types=None, reference="ort", **attrs):
    out_types = out_types or [_TYPES[next(iter(feeds.values())).dtype]] * n_out
    return _check(_model(op, feeds, out_types, opset, **attrs), feeds, reference)


def _randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_gather_negative_scalar_and_matrix_indices():
    x = _randn(3, 5, 2)
    y, = _same("Gather", {"x": x, "i": np.array(-1, np.int64)}, axis=1)
    assert y.shape == (3, 2)  # a scalar index removes the axis
    _same("Gather", {"x": x, "i": np.array([[0, -5], [4, -2]], np.int32)}, axis=-2)


@pytest.mark.gpu
def test_gathers_wrap_negative_indices_on_the_gpu_too():
    # the device path wraps with one remainder kernel instead of the CPU's where()
    import torch

    from kiln.ops.indexing import gather, gather_elements, gather_nd

    class Node:
        def __init__(self, **attrs):
            self.attrs = attrs

        def attr(self, name, default=None):
            return self.attrs.get(name, default)

    x = torch.randn(3, 5, 4)
    i = torch.tensor([[-1, 0], [4, -5]])
    nd = torch.tensor([[-1, 0], [2, -4]])
    cases = [(gather, Node(axis=1), i), (gather_elements, Node(axis=1), torch.randint(-5, 5, (3, 2, 4))),
             (gather_nd, Node(), nd)]
    for op, node, idx in cases:
        assert torch.equal(op(node, x.cuda(), idx.cuda()).cpu(), op(node, x, idx))


def test_gather_elements_negative_indices_on_inner_axis():
    x = _randn(2, 4, 3)
    i = rng.integers(-4, 4, size=(2, 2, 3)).astype(np.int64)
    _same("GatherElements", {"x": x, "i": i}, axis=1)


def test_gather_nd_batch_dims_slices_and_negative_indices():
    x = _randn(2, 3, 4, 5)
    i = np.array([[[-1], [0]], [[2], [-3]]], np.int64)  # batch_dims=1, k=1: whole (4, 5) slices
    y, = _same("GatherND", {"x": x, "i": i}, batch_dims=1)
    assert y.shape == (2, 2, 4, 5)
    i = np.array([[[0, -1], [2, 3]], [[-2, 0], [1, 1]]], np.int64)  # k=2: (3, 4) positions, rows of 5
    y, = _same("GatherND", {"x": x, "i": i}, batch_dims=1)
    assert y.shape == (2, 2, 5)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_reductions_with_duplicates_on_axis1(reduction):
    x = rng.integers(-5, 5, size=(3, 4)).astype(np.int32)
    i = np.array([[1, -3, 1], [0, 0, 3], [-1, 2, 2]], np.int64)
    if reduction == "none":
        i = np.array([[1, -2, 0], [0, 3, 2], [-1, 2, 1]], np.int64)  # duplicates are undefined without reduction
    u = rng.integers(-5, 5, size=(3, 3)).astype(np.int32)
    _same("ScatterElements", {"x": x, "i": i, "u": u}, axis=1, reduction=reduction)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_scatter_nd_reductions_on_unsigned_rows(reduction, dtype):
    x = rng.integers(0, 9, size=(4, 3, 2)).astype(dtype)
    i = np.array([[[1], [-1]], [[1], [0]]], np.int64)  # whole (3, 2) rows, row 1 twice
    u = rng.integers(0, 9, size=(2, 2, 3, 2)).astype(dtype)
    if dtype == np.uint64:
        u[0, 0, 0, 0], u[1, 0, 0, 0] = 2**64 - 1, 2**63  # above int64's range: order must survive
    _same("ScatterND", {"x": x, "i": i, "u": u}, reference="onnx", reduction=reduction)


def test_scatter_nd_element_indices_negative():
    x = _randn(3, 4)
    i = np.array([[-1, -1], [0, 2], [1, -4]], np.int64)
    _same("ScatterND", {"x": x, "i": i, "u": _randn(3)})


def test_scatter_opset10():
    x = np.zeros((3, 3), np.float32)
    i = np.array([[1, 0, 2], [0, 2, 1]], np.int64)
    _same("Scatter", {"x": x, "i": i, "u": _randn(2, 3)}, opset=10, axis=0)


@pytest.mark.parametrize("largest", [0, 1])
def test_top_k_ties_keep_lower_index_first(largest):
    x = np.array([[3, 1, 3, 2, 1, 3, 2, 1]] * 2, np.float32).T.copy()  # ties along axis 0
    feeds = {"x": x, "k": np.array([6], np.int64)}
    v, i = _same("TopK", feeds, out_types=[TensorProto.FLOAT, TensorProto.INT64], axis=0, largest=largest)
    order = np.argsort(-x[:, 0] if largest else x[:, 0], kind="stable")[:6]
    np.testing.assert_array_equal(i[:, 0], order)


def test_top_k_uint64_above_int64_range():
    x = np.array([2**64 - 1, 5, 2**63, 7, 2**63 - 1], np.uint64)
    v, i = _same("TopK", {"x": x, "k": np.array([3], np.int64)}, out_types=[TensorProto.UINT64, TensorProto.INT64],
                 reference="onnx")
    np.testing.assert_array_equal(i, [0, 2, 4])


def test_top_k_opset1_attribute():
    x = _randn(3, 7)
    _same("TopK", {"x": x}, out_types=[TensorProto.FLOAT, TensorProto.INT64], opset=1, k=2)


def test_one_hot_float_indices_axis0_float_depth():
    feeds = {"i": np.array([[1.0, -1.0], [5.0, 0.0]], np.float32), "d": np.array(4.0, np.float32),
             "v": np.array([-2, 9], np.int64)}
    y, = _same("OneHot", feeds, out_types=[TensorProto.INT64], reference="onnx", axis=0)
    assert y.shape == (4, 2, 2)


def test_reverse_sequence_batch_major_with_length_one():
    x = _randn(3, 5, 2)
    _same("ReverseSequence", {"x": x, "l": np.array([1, 5, 3], np.int64)}, batch_axis=0, time_axis=1)


@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_with_axis_all_outputs(sorted_):
    x = np.array([[2, 1, 2, 0], [1, 3, 1, 3], [2, 1, 2, 0]], np.int64)  # columns 0 and 2 repeat
    types = [TensorProto.INT64] * 4
    y, first, inverse, counts = _same("Unique", {"x": x}, out_types=types, axis=1, sorted=sorted_)
    np.testing.assert_array_equal(y[:, inverse], x)


def test_unique_unsorted_flat():
    x = np.array([4.0, 1.0, 4.0, -2.0, 1.0, 9.0], np.float32)
    types = [TensorProto.FLOAT] + [TensorProto.INT64] * 3
    y, first, inverse, counts = _same("Unique", {"x": x}, out_types=types, sorted=0)
    np.testing.assert_array_equal(y, [4.0, 1.0, -2.0, 9.0])


def test_value_dependent_shapes_in_an_engine():
    # NonZero/Compress outputs change size with the data: the engine runs them eagerly, run after run.
    model = _model("NonZero", {"x": np.zeros((2, 3), np.float32)}, [TensorProto.INT64])
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, shapes={"x": (2, 3)}))
    assert not engine.capturable
    ctx = engine.create_execution_context()
    for density in (0.0, 0.5, 1.0):
        x = (rng.random((2, 3)) < density).astype(np.float32)
        np.testing.assert_array_equal(ctx.run({"x": x})["y0"], np.array(np.nonzero(x)))
    cond = np.array([True, False, True, True, False, False, True])  # shorter than the flattened input
    _same("Compress", {"x": _randn(3, 4), "c": cond})


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_writes_each_batch_at_its_index(mode):
    """A KV cache (batch 3, 2 heads, 6 positions, 4 features) takes 2 new positions per sample on axis 2;
    circular mode wraps the sample written at position 5."""
    past = rng.standard_normal((3, 2, 6, 4)).astype(np.float32)
    update = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
    feeds = {"past": past, "update": update,
             "write_indices": np.array([0, 3, 5 if mode == "circular" else 4], np.int64)}
    model = _model("TensorScatter", feeds, [TensorProto.FLOAT], opset=24, axis=2, mode=mode)
    (got,) = _kiln(model, feeds)
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_array_equal(got, want)
    if mode == "circular":
        np.testing.assert_array_equal(got[2, :, 0], update[2, :, 1])  # wrapped to the front
