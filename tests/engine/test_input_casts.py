"""Inputs cast to a layer's precision on the way in (kiln/engine/interpreter.py cast_for)."""

import torch

from kiln.engine.interpreter import cast_for
from kiln.ir.graph import Node
from kiln.ops.registry import lookup


def test_an_fp32_attention_mask_saturates_into_an_fp16_layer():
    node = Node("Attention", ["q", "k", "v", "mask"], ["y"], {}, domain="kiln")
    node.precision = "float16"
    q = k = v = torch.randn(1, 2, 4, 8)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 0, :] = torch.finfo(torch.float32).min  # a fully masked row (a padding query), as HF writes it
    mask[..., 1:, :2] = torch.finfo(torch.float32).min  # and padded keys
    entry = lookup("Attention", "kiln")
    args = cast_for(node, entry, [q, k, v, mask])
    assert all(a.dtype == torch.float16 for a in args)
    assert torch.isfinite(args[3]).all() and args[3].min() == torch.finfo(torch.float16).min
    assert torch.isinf(mask.half()).any()  # what a plain cast would have made of it
    y = entry.impl(node, *[a.float() for a in args])
    assert torch.isfinite(y).all()  # a -inf row would be NaN (or the exporter's guard's zeros)
    torch.testing.assert_close(y[..., 1:, :], entry.impl(node, q, k, v, mask)[..., 1:, :], atol=1e-3, rtol=1e-3)


def test_a_convolution_input_is_cast_into_its_channels_last_weights_layout_in_one_copy():
    node = Node("FusedConv", ["x", "w"], ["y"], {"kernel_shape": [3, 3], "activation": "Relu"}, domain="kiln")
    node.precision = "float16"
    entry = lookup("FusedConv", "kiln")
    x = torch.randn(1, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3).half()
    got = cast_for(node, entry, [x, w.to(memory_format=torch.channels_last)])[0]
    assert got.dtype == torch.float16 and got.is_contiguous(memory_format=torch.channels_last)
    assert not got.is_contiguous()
    torch.testing.assert_close(got, x.half(), atol=0, rtol=0)
    plain = cast_for(node, entry, [x, w])[0]  # NCHW weights (CPU builds): the input stays NCHW
    assert plain.dtype == torch.float16 and plain.is_contiguous()


def test_a_skip_layernorm_scale_stays_fp32():
    # the 8-bit copy's scale is shared with the quantized GEMM that reads the copy: never narrowed per call
    node = Node("SkipLayerNorm", ["a", "b", "g", "beta", "s"], ["y", "sum", "q"], {"qtype": "int8"}, domain="kiln")
    node.precision = "float16"
    a = torch.randn(2, 8).half()
    args = cast_for(node, lookup("SkipLayerNorm", "kiln"), [a, a, torch.ones(8), torch.zeros(8), torch.tensor(0.02)])
    assert [t.dtype for t in args] == [torch.float16] * 4 + [torch.float32]


def test_a_weight_shared_with_an_fp32_layer_gets_an_fp16_copy():
    """Exporters share identical constants; the FP16 reader gets its own FP16 copy (no cast in every run) and the
    layer pinned to FP32 keeps the original."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import kiln

    c = numpy_helper.from_array(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "c")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "c"], ["h"], name="in_fp16"),
         helper.make_node("MatMul", ["h", "c"], ["y"], name="in_fp32")],
        "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    eng = kiln.build(model, kiln.BuildConfig(fp16=True, layer_precisions={"in_fp32": "fp32"}, progress=False))
    readers = {n.precision: n.inputs[1] for n in eng.graph.nodes if n.inputs[1:2] and n.inputs[1].startswith("c")}
    assert eng.graph.initializers[readers["float16"]].dtype == torch.float16
    assert eng.graph.initializers[readers["float32"]].dtype == torch.float32
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    cv = numpy_helper.to_array(c)
    np.testing.assert_allclose(eng.create_execution_context().run({"x": x})["y"], x @ cv @ cv, rtol=2e-2, atol=2e-2)


def test_a_quantized_engine_narrows_no_weight_in_its_runs(monkeypatch):
    """An FP16 + INT8 build of GEMM -> residual LayerNorm -> GEMM whose LayerNorm beta and first bias are one shared
    zero constant (as the exporter writes a freshly initialized BERT): the norm's beta and its 8-bit copy's scale
    reach it without a cast in every run (before: one copy kernel each per norm)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.engine import interpreter

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) / 4, n) for n in ("w1", "w2")]
    inits += [numpy_helper.from_array(np.zeros(16, np.float32), "zeros"),
              numpy_helper.from_array(np.ones(16, np.float32), "gamma")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "zeros"], ["a1"]),
             helper.make_node("Add", ["a1", "x"], ["res"]),
             helper.make_node("LayerNormalization", ["res", "gamma", "zeros"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    calib = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(25)]  # 100 samples
    eng = kiln.build(model, kiln.BuildConfig(fp16=True, int8=True, calib=calib, progress=False))
    assert {n.op_type for n in eng.graph.nodes} >= {"QGemm", "SkipLayerNorm"}
    ctx = eng.create_execution_context()
    x = rng.standard_normal((4, 16)).astype(np.float32)
    ctx.run({"x": x})  # first run: host values and uploads
    narrowed = []
    real = interpreter.cast_input

    def spy(entry, pos, a, want, channels_last=False):
        if interpreter.casts(entry, pos, a, want):
            narrowed.append((entry.op_type, pos, tuple(a.shape)))
        return real(entry, pos, a, want, channels_last)

    monkeypatch.setattr(interpreter, "cast_input", spy)
    ctx.run({"x": x})
    assert [c for c in narrowed if c[2] != (4, 16)] == []  # only the FP32 input itself may be cast
