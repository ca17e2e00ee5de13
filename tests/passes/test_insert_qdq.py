"""Post-training quantization: calibrated Q/DQ insertion, the INT8 engine, and the Q/DQ export."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.ir.from_onnx import model_to_graph
from kiln.passes import insert_qdq
from kiln.quant.qdq_export import export_qdq

from ..models import mlp


def _amax(model, x):
    """Calibration stand-in for the test: exact ranges of the two GEMM inputs on this data."""
    w = {t.name: np.frombuffer(t.raw_data, np.float32).reshape(tuple(t.dims)) for t in model.graph.initializer}
    h = np.maximum(x @ w["w1"] + w["b1"], 0)
    return {"x": float(np.abs(x).max()), "h2": float(np.abs(h).max())}


def test_quantize_weight_is_per_output_channel():
    w = torch.tensor([[1.0, -4.0], [0.5, 2.0]])  # [K, N]: channels are columns
    w_q, s = insert_qdq.quantize_weight(w, channel_axis=1)
    torch.testing.assert_close(s, torch.tensor([1.0, 4.0]) / 127)
    assert w_q.dtype == torch.int8 and w_q.abs().max() == 127


def _siblings(ranges):
    """Graph: MatMuls reading one input x, weight i filled with ranges[i] (largest |w|)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.full((8, 4), r, np.float32) * np.linspace(-1, 1, 4, dtype=np.float32),
                                     f"w{i}") for i, r in enumerate(ranges)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(len(ranges))]
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 4]) for i in range(len(ranges))]
    g = helper.make_graph(nodes, "siblings", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])], outs,
                          inits)
    graph = model_to_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    graph.quant_amax, graph.quant_type = {"x": 1.0}, "fp8"
    insert_qdq.run(graph)
    return [float(graph.initializers[f"mm{i}.weight_scale"]) for i in range(len(ranges))]


def test_fp8_gemms_reading_one_input_share_the_largest_weight_scale_within_16x():
    """Q, K and V share one FP8 weight scale, so their merged GEMM keeps one (cuBLASLt's FP8 GEMM takes no
    other kind on Hopper); a sibling 100x smaller would lose precision to subnormals, so then none share."""
    assert _siblings([1.0, 3.0, 0.5]) == pytest.approx([3.0 / 448] * 3)
    assert _siblings([1.0, 100.0]) == pytest.approx([1.0 / 448, 100.0 / 448])


def test_insertion_then_fusion_gives_int8_layers_close_to_fp32():
    model = mlp()
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    graph = model_to_graph(model)
    graph.quant_amax = _amax(model, x)
    insert_qdq.run(graph)
    assert [n.op_type for n in graph.nodes].count("QuantizeLinear") == 2
    # The same through the builder: INT8 layers, accuracy close to the float model.
    cfg = kiln.BuildConfig(device="cpu", progress=False, profiles=[kiln.Profile({"x": ((1, 8), (64, 8), (64, 8))})])
    fp32 = kiln.build(model, cfg).create_execution_context().run({"x": x})["y"]
    graph = model_to_graph(model)
    graph.quant_amax = _amax(model, x)
    int8 = kiln.build(graph, cfg)
    assert [n.op_type for n in int8.graph.nodes] == ["QGemm", "QGemm"]
    y = int8.create_execution_context().run({"x": x})["y"]
    assert np.abs(y - fp32).max() <= 0.02 * np.abs(fp32).max()


def test_exported_qdq_model_runs_in_onnxruntime_and_matches_the_engine(tmp_path):
    model = mlp()
    x = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    path = tmp_path / "mlp_int8.onnx"
    exported = export_qdq(model, _amax(model, x), path)
    assert {n.op_type for n in exported.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "MatMul"}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    cfg = kiln.BuildConfig(device="cpu", progress=False, profiles=[kiln.Profile({"x": ((1, 8), (16, 8), (16, 8))})])
    engine = kiln.build(exported, cfg)
    assert [n.op_type for n in engine.graph.nodes] == ["QGemm", "QGemm"]
    np.testing.assert_allclose(engine.create_execution_context().run({"x": x})["y"], ref, rtol=1e-4, atol=1e-4)
