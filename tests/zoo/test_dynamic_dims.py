"""-1, 0 and symbolic dimensions of ONNX inputs are dynamic axes (Paddle's exporters write -1)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import BuildConfig, Profile


def _model(path, batch_dim, width_dim):
    """x [batch, 4, width] -> Transpose -> MatMul [4, 3] -> Relu, saved as a file."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "w"], ["y0"]),
             helper.make_node("Relu", ["y0"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 4, width_dim])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, width_dim, 3])
    graph = helper.make_graph(nodes, "dyn", [x], [y], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    # onnx.helper writes -1/0 as dim_value, as Paddle's exporter does
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("batch_dim,width_dim", [(-1, 0), (0, "width"), ("N", -1)])
def test_minus_one_zero_and_named_dims_take_a_profile(tmp_path, batch_dim, width_dim):
    path = _model(str(tmp_path / "dyn.onnx"), batch_dim, width_dim)
    raw = onnx.load(path)
    assert raw.graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value") == isinstance(batch_dim, int)
    config = BuildConfig(profiles=[Profile({"x": ((1, 4, 2), (2, 4, 5), (4, 4, 8))})], device="cpu",
                         progress=False)
    engine = kiln.build(path, config)
    ctx = engine.create_execution_context()
    w = numpy_helper.to_array(raw.graph.initializer[0])
    for shape in ((1, 4, 2), (3, 4, 7), (4, 4, 8)):  # numpy is the reference: onnxruntime reads 0 as a fixed 0
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        got = ctx.run({"x": x})["y"]
        np.testing.assert_allclose(got, np.maximum(x.transpose(0, 2, 1) @ w, 0), rtol=1e-5, atol=1e-5)
    with pytest.raises(kiln.KilnError, match="outside optimization profile"):
        ctx.run({"x": np.zeros((5, 4, 2), np.float32)})


def test_in_memory_model_with_minus_one_builds_without_a_profile():
    path_free = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 3])]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match="dynamic axes \\[0\\]"):
        engine = kiln.build(path_free, BuildConfig(device="cpu", progress=False))
    assert engine.get_profile_shape(0, "x") == ((1, 3), (1, 3), (1, 3))
