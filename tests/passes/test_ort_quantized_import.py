"""Q/DQ models written by onnxruntime's own quantizer build into INT8 layers and match onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)

import kiln

from ..models import mlp, residual_blocks


class _Reader(CalibrationDataReader):
    def __init__(self, shape, seed, n):
        rng = np.random.default_rng(seed)
        self.items = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self.items, None)


def ort_reference(path, feeds):
    """onnxruntime's CPU output for the Q/DQ graph as written (no fusions of its own)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _quantized_and_built(tmp_path, model, calib_shape, x, profiles=(), **quantize_kw):
    """model quantized by onnxruntime's quantize_static (QDQ, per-channel, the given options), built by Kiln for
    the CPU: (the engine's op types, its output for x, onnxruntime's, the Q/DQ model's path)."""
    src, dst = tmp_path / "model.onnx", tmp_path / "model_qdq.onnx"
    onnx.save(model, src)
    quantize_static(str(src), str(dst), _Reader(calib_shape, seed=0, n=32 if len(calib_shape) == 2 else 16),
                    quant_format=QuantFormat.QDQ, per_channel=True, **quantize_kw)
    eng = kiln.build(str(dst), kiln.BuildConfig(device="cpu", progress=False, profiles=list(profiles)))
    got = next(iter(eng.create_execution_context().run({"x": x}).values()))
    return [n.op_type for n in eng.graph.nodes], got, ort_reference(dst, {"x": x}), dst


MLP_PROFILE = kiln.Profile({"x": ((1, 8), (6, 8), (8, 8))})


def test_symmetric_int8_qdq_from_onnxruntime_runs_as_int8(tmp_path):
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    ops, got, ref, _ = _quantized_and_built(tmp_path, mlp(), (4, 8), x, [MLP_PROFILE], activation_type=QuantType.QInt8,
                                            weight_type=QuantType.QInt8,
                                            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    assert ops.count("QGemm") == 2
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_onnxruntimes_default_asymmetric_int8_activations_run_as_int8(tmp_path):
    """quantize_static's defaults: int8 activations with zero points (and symmetric int8 weights)."""
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    ops, got, ref, dst = _quantized_and_built(tmp_path, mlp(), (4, 8), x, [MLP_PROFILE])
    zero_points = [numpy_helper.to_array(i) for i in onnx.load(dst).graph.initializer if "zero_point" in i.name]
    assert any(z.dtype == np.int8 and z.any() for z in zero_points)  # the case this test is for
    assert ops.count("QGemm") == 2
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations", [QuantType.QInt8, QuantType.QUInt8])
def test_onnxruntimes_default_quantization_of_residual_blocks_runs_every_conv_as_int8(tmp_path, activations):
    """Padded 3x3 and 1x1 convolutions with asymmetric int8 (the default) or uint8 activations (zero points),
    ResNet's residual adds."""
    x = np.random.default_rng(3).standard_normal((2, 4, 8, 8)).astype(np.float32)
    profile = kiln.Profile({"x": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 8, 8))})
    ops, got, ref, _ = _quantized_and_built(tmp_path, residual_blocks(2), (2, 4, 8, 8), x, [profile],
                                            activation_type=activations)
    assert ops.count("QConv") == 5 and "Conv" not in ops and "FusedConv" not in ops, ops
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_a_downsampling_block_whose_input_two_convolutions_read_runs_both_as_int8(tmp_path):
    """ResNet's first block of a stage: its 3x3 and its 1x1 downsample read one Q/DQ pair with a zero point;
    onnxruntime also writes the biases as dequantized int32 constants."""
    import torch
    from torch import nn

    class Down(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(4, 8, 3, padding=1)
            self.a, self.b = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Conv2d(16, 16, 3, padding=1)
            self.down = nn.Conv2d(8, 16, 1, stride=2)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            return torch.relu(self.b(torch.relu(self.a(x))) + self.down(x))

    torch.manual_seed(0)
    torch.onnx.export(Down().eval(), (torch.zeros(2, 4, 8, 8),), str(tmp_path / "down.onnx"), input_names=["x"],
                      output_names=["y"], dynamo=False)
    model = onnx.load(tmp_path / "down.onnx")
    x = np.random.default_rng(4).standard_normal((2, 4, 8, 8)).astype(np.float32)
    ops, got, ref, _ = _quantized_and_built(tmp_path, model, (2, 4, 8, 8), x)
    assert ops.count("QConv") == 4 and "Conv" not in ops and "FusedConv" not in ops, ops
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
