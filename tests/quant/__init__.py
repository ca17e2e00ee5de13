"""Shared, built-once material for the calibration tests (real engines, CPU)."""

import functools
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper

import kiln

CPU = {"device": "cpu", "progress": False}


@functools.cache
def digits():
    """The digits CNN (trained briefly: activations of a real net), its .onnx, calib and test .npz."""
    from kiln.examples import digits as ex

    return ex.prepare(tempfile.mkdtemp(prefix="kiln-quant-digits-"), epochs=2, exporter="onnx")


def digits_engine(lo=1, hi=64, **kw):
    return kiln.build(str(digits().onnx_path), kiln.BuildConfig(
        profiles=[kiln.Profile({"image": ((lo, 1, 8, 8), (hi, 1, 8, 8), (hi, 1, 8, 8))})], **CPU, **kw))


def relu_model(features: int = 4) -> onnx.ModelProto:
    """x[N, features] -> Relu -> y: the smallest model whose tensors' ranges are known by hand."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", features])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(x: np.ndarray, size: int, name: str = "x"):
    """An iterable of input dicts, `size` rows each."""
    return [{name: x[i:i + size]} for i in range(0, len(x), size)]
