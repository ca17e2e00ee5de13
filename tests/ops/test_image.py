"""Hand tests for image.py: ops and versions ONNX's node cases leave out (MaxRoiPool,
Resize-10/Upsample, RoiAlign-10, 3-D cubic GridSample), integer and FP16 paths, restrictions.

References are onnxruntime or ONNX's reference evaluator (same ONNX semantics).
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kiln
from kiln.errors import UnsupportedError

rng = np.random.default_rng(0)


def _model(op, feeds, consts=None, opset=19, n_out=1, **attrs):
    """One-node model; `consts` become initializers (host-known shape/scale arguments).

    Input order follows `feeds` then `consts` unless `order` lists the names ('' = omitted).
    """
    consts = consts or {}
    order = attrs.pop("order", None) or [*feeds, *consts]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, order, outs, name=f"{op.lower()}_under_test", **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outs],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    # IR 10 (opsets <= 21) loads in older onnxruntime builds too.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _kiln(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return [np.asarray(v) for v in engine.create_execution_context().run(feeds).values()], engine


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(model, feeds, reference, atol=1e-5):
    got, _ = _kiln(model, feeds)
    want = reference(model, feeds)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), atol=atol, rtol=1e-5)
    return got


def _reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


def _randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_max_roi_pool_matches_onnxruntime():
    # No ONNX node case exists: bins that overlap, fall off the map, and ROIs given back to front.
    rois = np.array([[0, 1, 1, 6, 4], [1, -3, -2, 4, 3], [1, 8.6, 2.4, 1.2, 9.7], [0, 0, 0, 11, 8],
                     [1, 20, 20, 30, 30]], np.float32)
    for scale, shape in ((1.0, [3, 2]), (0.5, [2, 4])):
        feeds = {"x": _randn(2, 3, 9, 12), "rois": rois}
        _check(_model("MaxRoiPool", feeds, opset=12, pooled_shape=shape, spatial_scale=scale), feeds, _ort)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_10_and_upsample_use_the_legacy_mapping(mode):
    # Resize-10 and Upsample map coordinates asymmetrically; nearest truncates (ceil when shrinking).
    x = _randn(1, 2, 5, 7)
    _check(_model("Resize", {"x": x}, {"scales": np.array([1, 1, 0.6, 1.7], np.float32)}, opset=10, mode=mode),
           {"x": x}, _ort)
    _check(_model("Upsample", {"x": x}, {"scales": np.array([1, 1, 2.5, 1.5], np.float32)}, opset=9, mode=mode),
           {"x": x}, _ort)
    _check(_model("Upsample", {"x": x}, opset=7, mode=mode, scales=[1.0, 1.0, 3.0, 2.0]), {"x": x}, _ort)


def test_resize_uint8_rounds_and_saturates():
    x = rng.integers(0, 256, (1, 3, 6, 5)).astype(np.uint8)
    model = _model("Resize", {"x": x}, {"sizes": np.array([4, 9], np.int64)}, opset=18, mode="cubic",
                   axes=[2, 3], order=["x", "", "", "sizes"])
    got = _check(model, {"x": x}, _reference, atol=1)  # the reference rounds from float64
    assert got[0].dtype == np.uint8


def test_resize_pytorch_half_pixel_to_one_pixel_samples_the_first():
    # The spec (and onnxruntime) map a length-1 output to coordinate 0; ONNX's reference uses -0.5.
    x = _randn(1, 1, 4, 6)
    model = _model("Resize", {"x": x}, {"sizes": np.array([1, 1, 3, 1], np.int64)}, opset=13, mode="cubic",
                   coordinate_transformation_mode="pytorch_half_pixel", order=["x", "", "", "sizes"])
    _check(model, {"x": x}, _ort, atol=1e-4)


def test_resize_fp16_build_is_close_to_fp32():
    x = _randn(1, 3, 8, 8)
    model = _model("Resize", {"x": x}, {"scales": np.array([1, 1, 1.5, 0.5], np.float32)}, mode="linear",
                   antialias=1, order=["x", "", "scales"])
    (full,), _ = _kiln(model, {"x": x})
    (half,), _ = _kiln(model, {"x": x}, fp16=True)
    np.testing.assert_allclose(half.astype(np.float32), full, atol=1e-2)


def test_grid_sample_3d_cubic_matches_reference():
    # ONNX's volumetric cases cover nearest/linear only; cubic is N-D since GridSample-20.
    feeds = {"x": _randn(1, 2, 3, 4, 3), "grid": rng.uniform(-1.2, 1.2, (1, 2, 2, 3, 3)).astype(np.float32)}
    for padding in ("zeros", "border", "reflection"):
        _check(_model("GridSample", feeds, opset=20, mode="cubic", padding_mode=padding), feeds, _reference,
               atol=1e-4)


def test_roi_align_10_uses_output_half_pixel():
    feeds = {"x": _randn(2, 3, 10, 9), "rois": np.array([[0.5, 1, 7, 6.5], [3, 2, 3.2, 2.1]], np.float32),
             "batch": np.array([1, 0], np.int64)}
    for mode in ("avg", "max"):
        _check(_model("RoiAlign", feeds, opset=10, mode=mode, output_height=3, output_width=2, spatial_scale=0.8),
               feeds, _ort, atol=1e-4)


def test_non_max_suppression_stays_fp32_and_defaults_to_no_output():
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 2, 1, 3]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    feeds = {"boxes": boxes, "scores": scores}
    (picked,), engine = _kiln(_model("NonMaxSuppression", feeds, {"limit": np.array([5], np.int64),
                                                                  "iou": np.array([0.5], np.float32)}, opset=11),
                              feeds, fp16=True)
    assert picked.tolist() == [[0, 0, 0], [0, 0, 2]]
    nms = next(n for n in engine.graph.nodes if n.op_type == "NonMaxSuppression")
    assert nms.precision == "float32" and "kept FP32" in nms.note
    (none,), _ = _kiln(_model("NonMaxSuppression", feeds, opset=11), feeds)
    assert none.shape == (0, 3)


@pytest.mark.parametrize("op, attrs, opset, message", [
    ("GridSample", {"padding_mode": "wrap"}, 20, "padding_mode 'wrap'"),
    ("Resize", {"coordinate_transformation_mode": "tf_half_pixel_for_nn"}, 13, "tf_half_pixel_for_nn"),
    ("DepthToSpace", {"blocksize": 2, "mode": "XYZ"}, 13, "mode 'XYZ'"),
])
def test_unsupported_attributes_are_reported_with_the_node(op, attrs, opset, message):
    feeds = {"x": _randn(1, 4, 4, 4)}
    if op == "GridSample":
        feeds["grid"] = _randn(1, 2, 2, 2)
    consts = {"scales": np.array([1, 1, 2, 2], np.float32)} if op == "Resize" else None
    order = ["x", "", "scales"] if op == "Resize" else None
    model = _model(op, feeds, consts, opset=opset, order=order, **attrs)
    with pytest.raises(UnsupportedError, match=message) as err:
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    assert f"{op.lower()}_under_test" in str(err.value)


_ROIS = np.array([[0.5, 1, 7, 6.5], [3, 2, 3.2, 2.1]], np.float32)
_GPU_CASES = {  # op: (feeds, host-known arguments, opset, attributes)
    "Resize": ({"x": _randn(2, 3, 9, 12)}, {"roi": np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32),
                                             "scales": np.array([1, 1, 0.6, 1.7], np.float32)}, 19,
               {"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize"}),
    "GridSample": ({"x": _randn(2, 3, 9, 12), "grid": rng.uniform(-1.2, 1.2, (2, 4, 5, 2)).astype(np.float32)},
                   None, 20, {"mode": "cubic", "padding_mode": "reflection"}),
    "AffineGrid": ({"theta": _randn(2, 3, 4)}, {"size": np.array([2, 3, 4, 5, 6], np.int64)}, 20, {}),
    "MaxRoiPool": ({"x": _randn(2, 3, 9, 12), "rois": np.array([[0, 1, 1, 6, 4], [1, -3, -2, 4, 3]], np.float32)},
                   None, 12, {"pooled_shape": [3, 2]}),
    "Col2Im": ({"x": _randn(2, 12, 42)}, {"image": np.array([5, 7]), "block": np.array([2, 2])}, 18,
               {"pads": [1, 0, 1, 1]}),
    "RoiAlign": ({"x": _randn(2, 3, 10, 9), "rois": _ROIS, "batch": np.array([1, 0])}, None, 16,
                 {"output_height": 3, "output_width": 2}),
    "NonMaxSuppression": ({"boxes": rng.uniform(0, 10, (1, 50, 4)).astype(np.float32),
                           "scores": rng.uniform(0, 1, (1, 3, 50)).astype(np.float32)},
                          {"limit": np.array([5]), "iou": np.array([0.3], np.float32)}, 11, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(_GPU_CASES))
def test_cuda_engine_matches_cpu(op):
    feeds, consts, opset, attrs = _GPU_CASES[op]
    model = _model(op, feeds, consts, opset=opset, **attrs)
    (want,), _ = _kiln(model, feeds)
    engine = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False))
    # Only the ops whose work depends on data values run eagerly; the rest replay as one CUDA graph.
    assert engine.capturable == (op not in ("RoiAlign", "NonMaxSuppression"))
    ctx = engine.create_execution_context()
    for _ in range(2):  # the second run replays the captured graph
        got = next(iter(ctx.run({k: torch.from_numpy(v).cuda() for k, v in feeds.items()}).values()))
        np.testing.assert_allclose(got.cpu().numpy(), want, atol=1e-4, rtol=1e-4)
