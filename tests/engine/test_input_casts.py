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
