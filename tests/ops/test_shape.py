"""Hand tests for shape.py: what ONNX's node cases leave out.

Dynamic shapes through shape arithmetic (and where it runs), ONNX's Slice
clamping where it differs from Python's, negative pads, attribute forms of
older opsets, unsigned types. References: onnxruntime, or numpy.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln

_TYPES = {np.dtype("float32"): TensorProto.FLOAT, np.dtype("int32"): TensorProto.INT32,
          np.dtype("int64"): TensorProto.INT64, np.dtype("uint16"): TensorProto.UINT16,
          np.dtype("bool"): TensorProto.BOOL}

rng = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=22):
    """inputs: {name: (elem_type, shape)}, outputs: {name: elem_type}, inits: {name: array}."""
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(k, t, None) for k, t in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()])
    # IR 11 (not onnx's newest) so that older onnxruntime builds load the model too.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def _single(op, feeds, inits=(), opset=22, out_type=None, **attrs):
    """A model with one `op` node reading `feeds` (graph inputs) then `inits` (weights)."""
    names = list(feeds) + list(dict(inits))
    node = helper.make_node(op, names, ["y"], **attrs)
    out_type = out_type or _TYPES[next(iter(feeds.values())).dtype]
    return _model([node], {k: (_TYPES[v.dtype], v.shape) for k, v in feeds.items()}, {"y": out_type}, inits, opset)


def _kiln(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _same_as_ort(model, feeds):
    got, want = _kiln(model, feeds), _ort(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return got


def _const(name, values):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(values, np.int64)))


def _flatten_heads_model():
    """x: (batch, 6, 4) -> Reshape to (batch, 3, 8) and (batch, -1), the targets computed from x's shape
    the way exporters write it: Shape -> Gather -> Unsqueeze -> Concat -> Reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("zero", 0),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        _const("axes0", [0]),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        _const("tail", [3, 8]),
        helper.make_node("Concat", ["batch1", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["heads"]),
        _const("minus1", [-1]),
        helper.make_node("Concat", ["batch1", "minus1"], ["flat_target"], axis=0),
        helper.make_node("Reshape", ["x", "flat_target"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["y"]),
    ]
    return _model(nodes, {"x": (TensorProto.FLOAT, ["batch", 6, 4])},
                  {"heads": TensorProto.FLOAT, "y": TensorProto.FLOAT})


def test_reshape_target_from_dynamic_batch_runs_on_host():
    model = _flatten_heads_model()
    profile = kiln.Profile({"x": ((1, 6, 4), (2, 6, 4), (8, 6, 4))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[profile]))
    ctx = engine.create_execution_context()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 8):
        x = rng.standard_normal((batch, 6, 4)).astype(np.float32)
        got = ctx.run({"x": x})
        heads, y = sess.run(None, {"x": x})
        assert got["heads"].shape == (batch, 3, 8) and got["y"].shape == (batch, 24)
        np.testing.assert_array_equal(got["heads"], heads)
        np.testing.assert_array_equal(got["y"], y)
    placement = {n.op_type: n.placement for n in engine.graph.nodes}
    for op in ("Shape", "Slice", "Squeeze", "Unsqueeze", "Concat"):  # Gather(shape, 0) is a Slice + Squeeze by now
        assert placement[op] == "host", f"{op} should be shape arithmetic on the host"
    assert placement["Reshape"] == "device" and placement["Relu"] == "device"
    assert engine.capturable  # the reshape targets are host values: still one CUDA graph per shape


def test_dynamic_slice_end_from_shape_arithmetic():
    # y = x[:, 1 : dim1 - 1] with dim1 read from the input's shape.
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
        _const("one", [1]),
        helper.make_node("Sub", ["shape", "one"], ["end"]),
        helper.make_node("Slice", ["x", "one", "end", "one"], ["y"]),
    ]
    model = _model(nodes, {"x": (TensorProto.FLOAT, [2, "n"])}, {"y": TensorProto.FLOAT})
    profile = kiln.Profile({"x": ((2, 3), (2, 6), (2, 10))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[profile]))
    ctx = engine.create_execution_context()
    for n in (3, 7, 10):
        x = rng.standard_normal((2, n)).astype(np.float32)
        np.testing.assert_array_equal(ctx.run({"x": x})["y"], x[:, 1:n - 1])
    assert {n.op_type: n.placement for n in engine.graph.nodes}["Sub"] == "host"


def test_shape_arithmetic_in_fp16_engine_keeps_int64():
    model = _flatten_heads_model()
    x = rng.standard_normal((2, 6, 4)).astype(np.float32)
    heads, y = _kiln(model, {"x": x}, fp16=True, shapes={"x": (2, 6, 4)})
    assert heads.shape == (2, 3, 8) and y.shape == (2, 24)
    np.testing.assert_allclose(heads, x.reshape(2, 3, 8), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("starts, ends, steps", [
    ([-100], [-200], [-1]),  # ONNX clamps start to 0 (Python would give -1: empty); takes x[0]
    ([100], [-100], [-2]),  # start clamps to dim-1, end to -1
    ([-2], [100], [3]),
    ([3], [1], [1]),  # empty
])
def test_slice_clamping_matches_onnx(starts, ends, steps):
    x = np.arange(10, dtype=np.float32).reshape(1, 10)
    inits = {"starts": np.array(starts), "ends": np.array(ends), "axes": np.array([1]), "steps": np.array(steps)}
    _same_as_ort(_single("Slice", {"x": x}, inits), {"x": x})


def test_slice_opset9_attributes():
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    y, = _same_as_ort(_single("Slice", {"x": x}, opset=9, starts=[1, -3], ends=[1000, -1], axes=[0, 2]), {"x": x})
    np.testing.assert_array_equal(y, x[1:, :, -3:-1])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_negative_pads_crop(mode):
    x = rng.standard_normal((3, 6, 5)).astype(np.float32)
    pads = np.array([0, -2, 2, 0, 1, -1])  # crop 2 at the start of axis 1, 1 at the end of axis 2
    _same_as_ort(_single("Pad", {"x": x}, {"pads": pads}, mode=mode), {"x": x})


def test_pad_wide_reflect_and_wrap_on_ints():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    for mode in ("reflect", "wrap"):
        inits = {"pads": np.array([2, 5, 2, 6])}  # wider than the axis: reflection/wrap repeat
        got, = _kiln(_single("Pad", {"x": x}, inits, mode=mode), {"x": x})
        np.testing.assert_array_equal(got, np.pad(x, [(2, 2), (5, 6)], mode="reflect" if mode == "reflect" else "wrap"))


def test_pad_opset2_attributes_and_int_value():
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    got, = _kiln(_single("Pad", {"x": x}, opset=2, pads=[1, 0, 0, 2], value=7.0), {"x": x})
    np.testing.assert_array_equal(got, np.pad(x, [(1, 0), (0, 2)], constant_values=7))


def test_reshape_allowzero_and_opset4_attribute():
    x = np.zeros((0, 4), dtype=np.float32)
    # The empty axis is given as the build shape: a 0 in an ONNX input's declared shape reads as dynamic.
    got, = _kiln(_single("Reshape", {"x": x}, {"s": np.array([4, 0])}, allowzero=1), {"x": x}, shapes={"x": (0, 4)})
    assert got.shape == (4, 0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    got, = _kiln(_single("Reshape", {"x": x}, opset=4, shape=[0, -1]), {"x": x})
    np.testing.assert_array_equal(got, x.reshape(2, 12))


def test_squeeze_unsqueeze_split_opset11_attributes():
    x = rng.standard_normal((1, 5, 1, 4)).astype(np.float32)
    y, = _same_as_ort(_single("Squeeze", {"x": x}, opset=11, axes=[-2, 0]), {"x": x})
    assert y.shape == (5, 4)
    y, = _same_as_ort(_single("Unsqueeze", {"x": x}, opset=11, axes=[-1, 0]), {"x": x})
    assert y.shape == (1, 1, 5, 1, 4, 1)
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=1, split=[2, 3])
    model = _model([node], {"x": (TensorProto.FLOAT, x.shape)}, {"a": TensorProto.FLOAT, "b": TensorProto.FLOAT},
                   opset=11)
    a, b = _same_as_ort(model, {"x": x})
    assert a.shape == (1, 2, 1, 4) and b.shape == (1, 3, 1, 4)


def test_expand_is_bidirectional():
    x = rng.standard_normal((3, 1, 4)).astype(np.float32)
    y, = _same_as_ort(_single("Expand", {"x": x}, {"shape": np.array([2, 1, 5, 1])}), {"x": x})
    assert y.shape == (2, 3, 5, 4)


def test_trilu_unsigned_and_k_beyond_matrix():
    x = np.arange(1, 25, dtype=np.uint16).reshape(2, 3, 4)
    for upper, k in ((1, -1), (0, 2), (1, 10), (0, -10)):
        got, = _kiln(_single("Trilu", {"x": x}, {"k": np.array(k)}, upper=upper), {"x": x})
        want = np.triu(x, k) if upper else np.tril(x, k)
        np.testing.assert_array_equal(got, want)


def test_range_exact_count_and_types():
    for start, limit, delta, dtype in ((10, 1, -3, np.int32), (0.0, 1.0, 0.1, np.float32), (5, 5, 1, np.int64)):
        feeds = {"s": np.array(start, dtype), "l": np.array(limit, dtype), "d": np.array(delta, dtype)}
        # No build-time validation run: its random integer inputs would include delta = 0.
        got, = _kiln(_single("Range", feeds), feeds, validate=False)
        np.testing.assert_allclose(got, np.arange(start, limit, delta, dtype=dtype), rtol=1e-6)
        assert got.dtype == dtype


def test_constant_of_shape_scalar_and_int_value():
    shape = np.array([], dtype=np.int64)
    value = numpy_helper.from_array(np.array([3], np.int32))
    got, = _kiln(_single("ConstantOfShape", {}, {"shape": shape}, out_type=TensorProto.INT32, value=value), {})
    got = got.cpu().numpy()  # no numpy feeds, so the engine answers with torch tensors
    assert got.shape == () and got.dtype == np.int32 and got == 3


def test_constant_inside_subgraph():
    # Folding turns top-level Constants into weights; a branch body's Constant runs as an op.
    branch = lambda v: helper.make_graph(  # noqa: E731
        [helper.make_node("Constant", [], ["c"], value_floats=[v, v]), helper.make_node("Add", ["x", "c"], ["r"])],
        "b", [], [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch(1.0), else_branch=branch(-1.0))
    model = _model([node], {"cond": (TensorProto.BOOL, []), "x": (TensorProto.FLOAT, [2])}, {"y": TensorProto.FLOAT})
    x = np.array([1.0, 2.0], np.float32)
    for cond, want in ((True, x + 1), (False, x - 1)):
        got, = _kiln(model, {"cond": np.array(cond), "x": x})
        np.testing.assert_array_equal(got, want)


def test_transpose_default_perm_and_flatten_negative_axis():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y, = _same_as_ort(_single("Transpose", {"x": x}), {"x": x})
    assert y.shape == (4, 3, 2)
    y, = _same_as_ort(_single("Flatten", {"x": x}, axis=-1), {"x": x})
    assert y.shape == (6, 4)


def test_dropout_inference_mask_types_and_training_mode():
    x = rng.standard_normal((64, 64)).astype(np.float32)
    for opset, mask_type in ((7, TensorProto.FLOAT), (13, TensorProto.BOOL)):
        attrs = {"ratio": 0.3} if opset < 12 else {}  # the ratio became an input in opset 12
        node = helper.make_node("Dropout", ["x"], ["y", "mask"], **attrs)
        outputs = {"y": TensorProto.FLOAT, "mask": mask_type}
        model = _model([node], {"x": (TensorProto.FLOAT, x.shape)}, outputs, opset=opset)
        y, mask = _kiln(model, {"x": x})
        np.testing.assert_array_equal(y, x)
        assert mask.all() and mask.dtype == (np.float32 if opset < 12 else np.bool_)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"])
    model = _model([node], {"x": (TensorProto.FLOAT, x.shape), "t": (TensorProto.BOOL, [])},
                   {"y": TensorProto.FLOAT, "mask": TensorProto.BOOL}, {"r": np.array(0.25, np.float32)})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, shapes={"x": x.shape}))
    assert not engine.capturable  # a replayed CUDA graph would repeat one mask
    ctx = engine.create_execution_context()
    out = ctx.run({"x": x, "t": np.array(False)})
    np.testing.assert_array_equal(out["y"], x)
    out = ctx.run({"x": x, "t": np.array(True)})
    kept = out["mask"]
    assert 0.6 < kept.mean() < 0.9  # about 1 - ratio of 4096 draws
    np.testing.assert_allclose(out["y"], np.where(kept, x / 0.75, 0), rtol=1e-6)
