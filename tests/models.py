"""Small ONNX models for the engine and tool tests (built in code, nothing downloaded)."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(batch="N", features=8, hidden=16, classes=4, seed=0, opset=17) -> onnx.ModelProto:
    """x[N, features] -> MatMul+Add -> Relu -> MatMul+Add -> y[N, classes], dynamic batch."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((hidden, classes)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="fc2"),
        helper.make_node("Add", ["h3", "b2"], ["y"], name="fc2_bias"),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def reshape_by_shape(opset=17) -> onnx.ModelProto:
    """y = Reshape(x, concat(shape(x)[0], -1)): the shape arithmetic exporters emit."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"], name="unsqueeze"),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"], name="reshape"),
        helper.make_node("Relu", ["flat"], ["y"], name="relu"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "axes0"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "minus1"),
    ]
    graph = helper.make_graph(
        nodes, "reshape_by_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 12])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mlp_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    h = np.maximum(x @ w["w1"] + w["b1"], 0)
    return h @ w["w2"] + w["b2"]


def residual_blocks(blocks: int, channels: int = 8, in_channels: int = 4, seed: int = 5) -> onnx.ModelProto:
    """A stem convolution, then `blocks` ResNet blocks o_i = Relu(Conv_c(Relu(Conv_b(o_{i-1}))) + o_{i-1}) (3x3 then
    1x1); input x [N, in_channels, H, W], output o_<blocks>."""
    rng = np.random.default_rng(seed)
    c = channels
    inits = [numpy_helper.from_array((rng.standard_normal((c, in_channels, 3, 3)) / (3 * in_channels)).astype(
        np.float32), "wa")]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["c0"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c0"], ["o0"])]
    for i in range(1, blocks + 1):
        inits += [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) / (3 * c)).astype(np.float32), f"wb{i}"),
                  numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / c).astype(np.float32), f"wc{i}")]
        nodes += [helper.make_node("Conv", [f"o{i - 1}", f"wb{i}"], [f"cb{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"cb{i}"], [f"p{i}"]),
                  helper.make_node("Conv", [f"p{i}", f"wc{i}"], [f"cc{i}"]),
                  helper.make_node("Add", [f"cc{i}", f"o{i - 1}"], [f"s{i}"]),
                  helper.make_node("Relu", [f"s{i}"], [f"o{i}"])]
    g = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          ["N", in_channels, "H", "W"])],
                          [helper.make_tensor_value_info(f"o{blocks}", TensorProto.FLOAT, ["N", c, "H", "W"])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)

