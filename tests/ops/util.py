"""One-op models run through Kiln (CPU target) and onnxruntime, for the op families' hand tests."""

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import kiln

TYPES = {np.dtype("float32"): TensorProto.FLOAT, np.dtype("float16"): TensorProto.FLOAT16,
         np.dtype("int32"): TensorProto.INT32, np.dtype("int64"): TensorProto.INT64,
         np.dtype("uint32"): TensorProto.UINT32, np.dtype("uint8"): TensorProto.UINT8}


def single_op_model(op, feeds, outs=("y",), opset=22, out_types=None, **attrs):
    """A graph of one `op` node reading `feeds` (numpy arrays); outputs default to the first feed's type."""
    node = helper.make_node(op, list(feeds), list(outs), name=f"{op.lower()}_under_test", **attrs)
    out_types = out_types or [TYPES[next(iter(feeds.values())).dtype]] * len(outs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, TYPES[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types)])
    # IR 11 (not onnx's newest) so that older onnxruntime builds load the model too.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def run_kiln(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


def run_ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
