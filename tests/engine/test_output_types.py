"""A layer that computes a model's FP32 output writes it in FP32 in a low-precision engine (builder/precision.py)."""

import numpy as np
import torch
from onnx import TensorProto, helper

import kiln

from ..passes.test_fuse_pooled_gemm import _head
from ..passes.util import rand


def _build(model, **kw):
    return kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **kw))


def test_a_cnn_head_writes_the_fp32_output_itself_in_an_fp16_engine(tmp_path):
    _build(_head(), fp16=True).save(tmp_path / "head.kiln")
    fp16, fp32 = kiln.load(tmp_path / "head.kiln"), _build(_head())  # the attribute survives the engine file
    (head,) = [n for n in fp16.graph.nodes if n.op_type == "PooledGemm"]
    assert head.precision == "float16" and head.attr("output_type") == "float32"
    assert [n.attr("output_type") for n in fp32.graph.nodes] == [None]  # FP32 engines need no such thing
    x = rand(2, 6, 4, 3, seed=4)
    got = fp16.create_execution_context().run({"x": torch.as_tensor(x)})["y"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, fp32.create_execution_context().run({"x": torch.as_tensor(x)})["y"],
                               atol=1e-2, rtol=1e-2)


def test_an_output_another_layer_reads_keeps_the_layers_precision():
    m = _head()
    m.graph.node.append(helper.make_node("Neg", ["y"], ["z"]))
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 5]))
    engine = _build(m, fp16=True)
    (head,) = [n for n in engine.graph.nodes if n.op_type == "PooledGemm"]
    assert head.attr("output_type") is None  # Neg reads it: an FP32 copy would cost Neg a cast instead
    out = engine.create_execution_context().run({"x": rand(2, 6, 4, 3, seed=4)})
    assert out["y"].dtype == np.float32 and out["z"].dtype == np.float32


def _last_norm():
    """out = LayerNorm(x + r): a transformer's last residual add and norm as a model's FP32 output."""
    g = torch.Generator().manual_seed(6)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [16], torch.randn(16, generator=g).tolist())
             for n in ("gamma", "beta")]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 16]) for n in ("x", "r", "out")]
    graph = helper.make_graph(nodes, "last_norm", io[:2], io[2:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_a_transformers_last_norm_writes_the_fp32_output_itself_in_an_fp16_engine():
    fp16, fp32 = _build(_last_norm(), fp16=True), _build(_last_norm())
    (norm,) = [n for n in fp16.graph.nodes if n.op_type == "SkipLayerNorm"]
    assert norm.precision == "float16" and norm.attr("output_type") == "float32"
    feeds = {"x": torch.as_tensor(rand(2, 3, 16, seed=1)), "r": torch.as_tensor(rand(2, 3, 16, seed=2))}
    got = fp16.create_execution_context().run(feeds)["out"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, fp32.create_execution_context().run(feeds)["out"], atol=2e-2, rtol=2e-2)
