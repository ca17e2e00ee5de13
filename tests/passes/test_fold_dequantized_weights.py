"""Integer weights that fuse_qdq did not take (their layer's activation is not quantized) become float weights."""

import numpy as np
import torch
from onnx import helper

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import fold_constants, fold_dequantized_weights, fuse_qdq

from .util import check_pass, model, ops, rand


def _float_matmul_on_int8_weights():
    w = np.random.default_rng(0).integers(-127, 128, (8, 6)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "sw"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    return model(nodes, [("x", [3, 8])], [("y", [3, 6])],
                 {"wq": w, "sw": np.linspace(0.01, 0.02, 6).astype(np.float32)}), w


def test_the_dequantize_of_weights_left_in_float_runs_once_at_build_time():
    onnx_model, w = _float_matmul_on_int8_weights()
    _, after = check_pass(fold_dequantized_weights, onnx_model, {"x": rand(3, 8)})
    assert ops(after) == ["MatMul"]
    weight = after.initializers[after.nodes[0].inputs[1]]
    assert weight.dtype == torch.float32
    torch.testing.assert_close(weight, torch.from_numpy(w).float() * torch.linspace(0.01, 0.02, 6))


def test_the_passes_before_it_leave_that_dequantize_for_it():
    graph = model_to_graph(_float_matmul_on_int8_weights()[0])
    fold_constants.run(graph)  # keeps DequantizeLinear of integer weights for fuse_qdq
    fuse_qdq.run(graph)  # the activation is not quantized: nothing to fuse, and nothing folded
    assert ops(graph) == ["DequantizeLinear", "MatMul"]
    fold_dequantized_weights.run(graph)
    assert ops(graph) == ["MatMul"]
