"""Built-in models: the embedded default that `kiln build` compiles when given no model.

Built in code with onnx.helper and seeded weights, so nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def tiny_cnn(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """A small image classifier: 3x32x32 -> 10 classes, dynamic batch.

    Conv-BN-ReLU x2, max pool, global average pool, a linear head and softmax:
    the layer mix of a real CNN, small enough to build in a second on a CPU.
    """
    rng = np.random.default_rng(seed)
    inits = []

    def weight(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        w = (rng.standard_normal(shape) * (scale or np.sqrt(2.0 / fan_in))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, name))
        return name

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    nodes = []
    x = "image"
    for i, (cin, cout) in enumerate([(3, 16), (16, 32)]):
        nodes.append(helper.make_node("Conv", [x, weight(f"conv{i}.weight", cout, cin, 3, 3)], [f"conv{i}"],
                                      name=f"conv{i}", pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node(
            "BatchNormalization",
            [f"conv{i}", const(f"bn{i}.scale", 1 + 0.1 * rng.standard_normal(cout)),
             const(f"bn{i}.bias", 0.1 * rng.standard_normal(cout)),
             const(f"bn{i}.mean", 0.1 * rng.standard_normal(cout)),
             const(f"bn{i}.var", 1 + 0.1 * rng.random(cout))],
            [f"bn{i}"], name=f"bn{i}"))
        nodes.append(helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"], name=f"relu{i}"))
        x = f"relu{i}"
        if i == 0:
            nodes.append(helper.make_node("MaxPool", [x], ["pool0"], name="pool0", kernel_shape=[2, 2], strides=[2, 2]))
            x = "pool0"
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", weight("fc.weight", 10, 32), const("fc.bias", np.zeros(10))], ["logits"],
                         name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "kiln_tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="kiln")
    onnx.checker.check_model(model)
    return model


DEFAULT_PROFILE = {"image": ((1, 3, 32, 32), (8, 3, 32, 32), (32, 3, 32, 32))}
