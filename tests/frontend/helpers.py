"""Small ONNX models built in code for the frontend tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(opset: int = 17, batch="batch", seed: int = 0) -> onnx.ModelProto:
    """x[batch, 64] -> MatMul(w) -> Add(b) -> Relu -> y[batch, 64]; w is 16 KiB (big enough for external data)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Add", ["h", "b"], ["h2"], name="bias"),
        helper.make_node("Relu", ["h2"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 64])],
        [w, b],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def graph_model(nodes, inputs, outputs, inits=(), opset: int = 17, extra_opsets=(), functions=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets], functions=list(functions)
    )


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def save_external(model: onnx.ModelProto, folder, name="model.onnx", location="model.data"):
    """Save with every tensor (threshold 0) in one external data file; returns the model path."""
    path = folder / name
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def set_location(path, tensor: str, **fields) -> None:
    """Rewrite the external_data fields of one tensor of a saved model (without loading its data)."""
    m = onnx.load(str(path), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == tensor)
    current = {e.key: e.value for e in t.external_data}
    current.update({k: str(v) for k, v in fields.items() if v is not None})
    for k in [k for k, v in fields.items() if v is None]:
        current.pop(k, None)
    del t.external_data[:]
    for k, v in current.items():
        e = t.external_data.add()
        e.key, e.value = k, v
    onnx.save_model(m, str(path))
