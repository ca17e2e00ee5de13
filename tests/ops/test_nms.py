"""NonMaxSuppression against ONNX's reference evaluator on generated cases: several batches and classes, both box
formats, flipped corners, empty boxes, tied scores, with and without a score threshold, limits below and above
the box count. Kiln selects every batch and class at once (ops/image.py); the reference loops box by box."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kiln


def _model(center_point_box: int, limit, iou, score):
    consts = [numpy_helper.from_array(np.array([limit], np.int64), "limit"),
              numpy_helper.from_array(np.array([iou], np.float32), "iou")]
    names = ["boxes", "scores", "limit", "iou"]
    if score is not None:
        consts.append(numpy_helper.from_array(np.array([score], np.float32), "score"))
        names.append("score")
    node = helper.make_node("NonMaxSuppression", names, ["selected"], center_point_box=center_point_box)
    graph = helper.make_graph(
        [node], "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, None)], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    return model


def _case(rng, batches: int, classes: int, n: int, center_point_box: int):
    xy = rng.uniform(0, 40, (batches, n, 2))
    wh = rng.uniform(0, 15, (batches, n, 2))
    wh[:, : n // 10] = 0  # empty boxes never suppress nor are suppressed
    if center_point_box:
        wh[:, n // 10: n // 5] *= -1  # a negative width or height: an empty box, never swapped
        boxes = np.concatenate([xy, wh], -1)
    else:
        a, b = xy, xy + wh
        flip = rng.random((batches, n, 1)) < 0.3  # corners listed either way round
        a, b = np.where(flip, b, a), np.where(flip, a, b)
        boxes = np.concatenate([a[..., ::-1], b[..., ::-1]], -1)  # [y1, x1, y2, x2]
    scores = rng.choice(np.linspace(0, 1, 21), (batches, classes, n))  # many ties
    return boxes.astype(np.float32), scores.astype(np.float32)


@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("limit, iou, score", [(5, 0.5, 0.3), (1000, 0.3, None), (3, 0.0, 0.1), (40, 0.99, None)])
def test_matches_the_onnx_reference(center_point_box, limit, iou, score):
    rng = np.random.default_rng(center_point_box * 100 + (limit or 0))
    model = _model(center_point_box, limit, iou, score)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, shapes={
        "boxes": (2, 60, 4), "scores": (2, 4, 60)}))
    ctx = engine.create_execution_context()
    for _ in range(3):
        boxes, scores = _case(rng, 2, 4, 60, center_point_box)
        (want,) = ReferenceEvaluator(model).run(None, {"boxes": boxes, "scores": scores})
        got = ctx.run({"boxes": boxes, "scores": scores})["selected"]
        assert got.dtype == np.int64 and got.shape[1:] == (3,)
        np.testing.assert_array_equal(got, want.reshape(-1, 3))


def test_a_class_without_candidates_and_a_chain_of_overlaps():
    # Class 0: a chain of boxes each overlapping the next, so the greedy answer keeps every other one; class 1:
    # every score at or below the threshold, so nothing.
    boxes = np.array([[[0, x, 1, x + 1] for x in np.arange(0, 6, 0.5)]], np.float32)
    scores = np.stack([np.linspace(1, 0.5, 12), np.full(12, 0.2)])[None].astype(np.float32)
    model = _model(0, 100, 0.2, 0.2)
    (want,) = ReferenceEvaluator(model).run(None, {"boxes": boxes, "scores": scores})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, shapes={
        "boxes": boxes.shape, "scores": scores.shape}))
    got = engine.create_execution_context().run({"boxes": boxes, "scores": scores})["selected"]
    assert got[:, 2].tolist() == list(range(0, 12, 2)) and set(got[:, 1].tolist()) == {0}
    np.testing.assert_array_equal(got, want)
