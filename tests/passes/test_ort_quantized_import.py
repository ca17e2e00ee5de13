"""Q/DQ models written by onnxruntime's own quantizer build into INT8 layers and match onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)

import kiln

from ..models import mlp


class _Reader(CalibrationDataReader):
    def __init__(self, n=32):
        rng = np.random.default_rng(0)
        self.items = iter([{"x": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self.items, None)


def test_symmetric_int8_qdq_from_onnxruntime_runs_as_int8(tmp_path):
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp_qdq.onnx"
    onnx.save(mlp(), src)
    quantize_static(str(src), str(dst), _Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, per_channel=True,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ graph as written
    ref = ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    eng = kiln.build(str(dst), kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 8), (6, 8), (8, 8))})]))
    assert sum(n.op_type == "QGemm" for n in eng.graph.nodes) == 2
    np.testing.assert_allclose(eng.create_execution_context().run({"x": x})["y"], ref, rtol=1e-4, atol=1e-4)


def test_onnxruntimes_default_asymmetric_int8_activations_run_as_int8(tmp_path):
    """quantize_static's defaults: int8 activations with zero points (and symmetric int8 weights)."""
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp_qdq.onnx"
    onnx.save(mlp(), src)
    quantize_static(str(src), str(dst), _Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    zero_points = [numpy_helper.to_array(i) for i in onnx.load(dst).graph.initializer if "zero_point" in i.name]
    assert any(z.dtype == np.int8 and z.any() for z in zero_points)  # the case this test is for
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    eng = kiln.build(str(dst), kiln.BuildConfig(device="cpu", progress=False,
                                                profiles=[kiln.Profile({"x": ((1, 8), (6, 8), (8, 8))})]))
    assert sum(n.op_type == "QGemm" for n in eng.graph.nodes) == 2
    np.testing.assert_allclose(eng.create_execution_context().run({"x": x})["y"], ref, rtol=1e-4, atol=1e-4)
