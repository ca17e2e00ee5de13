"""INT4 weight-only: MatMul on blocked INT4 DequantizeLinear -> kiln::Int4Gemm, matching onnxruntime."""

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln


def _int4_model(k=40, n=24, block=8):
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 8, (k, n))
    scales = rng.uniform(0.01, 0.05, (k // block, n)).astype(np.float32)
    inits = [
        helper.make_tensor("w", TensorProto.INT4, [k, n], w.flatten().tolist()),
        numpy_helper.from_array(scales, "s"),
        numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=block),
        helper.make_node("MatMul", ["x", "wf"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
    ]
    g = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_int4_weights_stay_packed_and_match_onnxruntime():
    model = _int4_model()
    x = np.random.default_rng(1).standard_normal((5, 40)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    eng = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False,
                                             profiles=[kiln.Profile({"x": ((1, 40), (5, 40), (8, 40))})]))
    assert [n.op_type for n in eng.graph.nodes] == ["Int4Gemm"]
    packed = eng.graph.initializers[eng.graph.nodes[0].inputs[1]]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (20, 24)  # two weights per byte
    np.testing.assert_allclose(eng.create_execution_context().run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)
