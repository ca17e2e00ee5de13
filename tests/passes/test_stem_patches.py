"""A stride-2 RGB stem -> stem patches + a stride-1 convolution over 64 channels, in INT8/FP8 builds only."""

import copy

import pytest
import torch

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import stem_patches

from .util import helper, model, ops, rand, run


def _stem(kernel, pads, size=16, channels=3, strides=(2, 2)):
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="stem", pads=list(pads), strides=list(strides))
    return model([conv],
                 [("x", ["N", channels, size, size])], [("y", None)],
                 {"w": rand(8, channels, kernel, kernel, seed=1), "b": rand(8, seed=2)})


def _rewritten(m, amax=3.0):
    before = model_to_graph(m)
    before.quant_amax = {"x": amax}
    after = copy.deepcopy(before)
    stem_patches.run(after)
    return before, after


@pytest.mark.parametrize("kernel,pads,size", [(7, (3, 3, 3, 3), 16), (7, (3, 3, 3, 3), 18), (3, (1, 1, 1, 1), 10),
                                              (5, (2, 2, 2, 2), 12), (4, (1, 1, 1, 1), 8), (3, (0, 0, 0, 0), 8),
                                              (7, (3, 2, 2, 3), 14)])
def test_a_stride_2_stem_becomes_patches_and_the_same_numbers(kernel, pads, size):
    before, after = _rewritten(_stem(kernel, pads, size))
    assert ops(after) == ["kiln::StemPatches", "Conv"]
    conv = after.nodes[1]
    assert conv.name == "stem" and conv.attr("strides") == [1, 1] and conv.attr("kernel_shape")[1] == 1
    assert after.initializers[conv.inputs[1]].shape[1] % 16 == 0  # 4 phases x 4 channels per cell column
    assert after.quant_amax[after.nodes[0].outputs[0]] == 3.0  # the image's values, rearranged
    feeds = {"x": torch.as_tensor(rand(2, 3, size, size, seed=3)).double()}
    for g in (before, after):
        g.initializers = {k: v.double() for k, v in g.initializers.items()}
    want, got = run(before, feeds)[0], run(after, feeds)[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_the_patches_of_a_7x7_stem_hold_each_cell_column_side_by_side():
    _, after = _rewritten(_stem(7, (3, 3, 3, 3), 224))
    p = after.nodes[0]
    assert (p.attr("channels"), p.attr("first"), p.attr("columns"), p.attr("width")) == (4, -2, 4, 112)
    assert after.nodes[1].attr("pads") == [2, 0, 1, 0] and after.nodes[1].attr("kernel_shape") == [4, 1]
    assert tuple(after.initializers["stem.patch_weight"].shape) == (8, 64, 4, 1)


@pytest.mark.parametrize("why", ["float build", "stride 1", "odd size", "four channels", "pinned"])
def test_other_convolutions_are_left_alone(why):
    m = _stem(7, (3, 3, 3, 3), size=15 if why == "odd size" else 16, channels=4 if why == "four channels" else 3,
              strides=(1, 1) if why == "stride 1" else (2, 2))
    graph = model_to_graph(m)
    graph.quant_amax = None if why == "float build" else {"x": 3.0}
    if why == "pinned":
        graph.nodes[0].note = "pinned to fp16 by --layerPrecisions"
    stem_patches.run(graph)
    assert ops(graph) == ["Conv"]
