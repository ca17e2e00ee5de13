"""Hand tests for attention.py: RotaryEmbedding in the layouts ONNX's node cases leave out
(3-D input with position ids and partial interleaved rotation, an FP16 build). Reference: ONNX's
reference evaluator."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import kiln
from kiln.errors import UnsupportedError

rng = np.random.default_rng(0)


def _rope_model(x_shape, cache_shape, with_positions, **attrs):
    inputs = ["x", "cos", "sin"] + (["pos"] if with_positions else [])
    node = helper.make_node("RotaryEmbedding", inputs, ["y"], name="rope", **attrs)
    vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
           helper.make_tensor_value_info("cos", TensorProto.FLOAT, cache_shape),
           helper.make_tensor_value_info("sin", TensorProto.FLOAT, cache_shape)]
    if with_positions:
        vis.append(helper.make_tensor_value_info("pos", TensorProto.INT64, x_shape[:2]))
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _feeds(x_shape, cache_shape, with_positions):
    angles = rng.uniform(0, 2 * np.pi, cache_shape).astype(np.float32)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}
    if with_positions:
        feeds["pos"] = rng.integers(0, cache_shape[0], x_shape[:2]).astype(np.int64)
    return feeds


def _kiln(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return engine.create_execution_context().run(feeds)["y"]


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_3d_input_with_positions_and_partial_rotation(interleaved):
    # 3 heads of 8 features packed in 24; only the first 4 features of each head rotate.
    x_shape, cache_shape = [2, 5, 24], [16, 2]
    model = _rope_model(x_shape, cache_shape, True, num_heads=3, rotary_embedding_dim=4, interleaved=interleaved)
    feeds = _feeds(x_shape, cache_shape, True)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(_kiln(model, feeds), want, rtol=1e-5, atol=1e-6)
    unrotated = feeds["x"].reshape(2, 5, 3, 8)[..., 4:]
    np.testing.assert_array_equal(_kiln(model, feeds).reshape(2, 5, 3, 8)[..., 4:], unrotated)


def test_rotary_fp16_build_stays_within_half_precision():
    x_shape, cache_shape = [1, 4, 6, 16], [1, 6, 8]  # 4-D input, caches per (batch, position)
    model = _rope_model(x_shape, cache_shape, False)
    feeds = _feeds(x_shape, cache_shape, False)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = _kiln(model, feeds, fp16=True)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_rotary_odd_rotation_dim_is_refused():
    model = _rope_model([1, 2, 3, 8], [4, 2], True, rotary_embedding_dim=3)
    with pytest.raises(UnsupportedError, match="rope.*rotary_embedding_dim=3 must be even"):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
