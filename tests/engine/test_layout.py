"""Weight layouts chosen for a GPU (kiln/builder/layout.py)."""

import numpy as np
import torch

import kiln
from kiln.builder import layout

from ..models import mlp


def _int8_mlp_engine():
    calib = [{"x": np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32)} for i in range(4)]
    prof = kiln.Profile({"x": ((1, 8), (4, 8), (8, 8))})
    return kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], int8=True, calib=calib))


def test_quantized_gemm_weights_are_stored_k_major_on_a_gpu_only(tmp_path):
    engine = _int8_mlp_engine()
    qgemm_weights = sorted(n.inputs[1] for n in engine.graph.nodes if n.op_type == "QGemm")
    assert len(qgemm_weights) == 2
    assert layout.column_major_weights(engine.graph, "cuda") == qgemm_weights
    assert layout.column_major_weights(engine.graph, "cpu") == [] == engine.column_major

    engine.column_major = qgemm_weights  # as a GPU build records them; the file keeps the list
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    assert again.column_major == qgemm_weights
    w = again.weights_on_target()[qgemm_weights[0]]  # placed on this machine's target with the layout
    assert w.stride() == (1, w.shape[0]) and torch.equal(w, engine.graph.initializers[qgemm_weights[0]])
    x = torch.randn(3, 8)
    torch.testing.assert_close(again.create_execution_context().run({"x": x})["y"],
                               engine.create_execution_context().run({"x": x})["y"])


def _rgb_stem(filters: int):
    """A 3x3 stride-2 RGB stem of `filters` filters + ReLU reading the image, then a 3x3 convolution to 8 channels."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in [("ws", (filters, 3, 3, 3)), ("w1", (8, filters, 3, 3))]]
    nodes = [helper.make_node("Conv", ["image", "ws"], ["s"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["s"], ["r"]), helper.make_node("Conv", ["r", "w1"], ["y"], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 8, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_an_rgb_stem_reading_the_image_gets_a_zero_fourth_channel_and_the_same_results(tmp_path):
    prof = kiln.Profile({"image": ((2, 3, 16, 16),) * 3})

    def build(filters):
        return kiln.build(_rgb_stem(filters), kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))

    engine = build(32)
    assert layout.channels_last_weights(engine.graph, "cpu", "float32") == [] == engine.padded_channels
    convs = [n for n in engine.graph.nodes if n.op_type in ("Conv", "FusedConv")]
    nhwc = layout.channels_last_weights(engine.graph, "cuda", "float16")
    assert sorted(n.inputs[1] for n in convs) == nhwc  # both convolutions; only the stem reads the image
    stem = [n.inputs[1] for n in convs if n.inputs[0] == "image"]
    assert layout.padded_channel_weights(engine.graph, nhwc) == stem

    engine.channels_last, engine.padded_channels = nhwc, stem  # as a GPU build records them
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    assert again.padded_channels == stem
    w = again.weights_on_target()[stem[0]]
    assert w.shape[1] == 4 and (w[:, 3] == 0).all() and w.is_contiguous(memory_format=torch.channels_last)
    assert engine.graph.initializers[stem[0]].shape[1] == 3  # the file keeps the model's weight
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(again.create_execution_context().run({"image": x})["y"],
                               build(32).create_execution_context().run({"image": x})["y"])


def test_a_stem_of_fewer_than_32_filters_keeps_three_channels():
    """cuDNN's heuristic runs a 16-filter stem over four channels on a slow kernel (builder/layout.py)."""
    prof = kiln.Profile({"image": ((2, 3, 16, 16),) * 3})
    engine = kiln.build(_rgb_stem(16), kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))
    nhwc = layout.channels_last_weights(engine.graph, "cuda", "float16")
    assert len(nhwc) == 2 and layout.padded_channel_weights(engine.graph, nhwc) == []


def _depthwise_then_pointwise():
    """A depthwise 3x3 convolution + ReLU, then a 1x1 convolution: weights [8, 1, 3, 3] and [16, 8, 1, 1], whose
    size-1 axes make them count as contiguous in both layouts."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in [("wd", (8, 1, 3, 3)), ("wp", (16, 8, 1, 1))]]
    nodes = [helper.make_node("Conv", ["x", "wd"], ["d"], group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["d"], ["r"]), helper.make_node("Conv", ["r", "wp"], ["y"])]
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 6, 6])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_channels_last_weights_get_channels_last_strides_on_their_size_1_axes_too(tmp_path):
    from torch._prims_common import suggest_memory_format

    prof = kiln.Profile({"x": ((2, 8, 6, 6),) * 3})

    def build():
        return kiln.build(_depthwise_then_pointwise(), kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))

    engine = build()
    engine.channels_last = layout.channels_last_weights(engine.graph, "cuda", "float16")  # as a GPU build does
    assert len(engine.channels_last) == 2
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    placed = again.weights_on_target()
    strides = sorted(placed[k].stride() for k in again.channels_last)
    assert strides == [(8, 1, 8, 8), (9, 1, 3, 1)]  # [16, 8, 1, 1] and [8, 1, 3, 3], channels fastest
    assert all(suggest_memory_format(placed[k]) == torch.channels_last for k in again.channels_last)
    x = torch.randn(2, 8, 6, 6)
    torch.testing.assert_close(again.create_execution_context().run({"x": x})["y"],
                               build().create_execution_context().run({"x": x})["y"])
