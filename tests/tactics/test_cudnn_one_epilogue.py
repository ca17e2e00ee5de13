"""tactics/cudnn_one_epilogue.py: offered at the default level to convolutions with a bias, and its functions
compute the layer (the convolution on the CPU here, its generated epilogue under Triton's interpreter). Timed in
real GPU builds (the zoo)."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.ops.fused import fused_conv
from kiln.tactics import candidates, load_all
from kiln.tactics.cudnn_one_epilogue import (
    _applies,
    cudnn_conv_benchmarked_one_epilogue,
    cudnn_conv_one_epilogue,
)


def test_offered_at_the_default_level_to_fused_and_onnx_convolutions():
    load_all()
    for op, domain in (("FusedConv", "kiln"), ("Conv", "")):
        names = {t.name for t in candidates(Node(op, [], [], {}, domain=domain)) if t.level <= 3}
        assert {"cudnn_conv_one_epilogue", "cudnn_conv_benchmarked_one_epilogue"} <= names


@pytest.mark.parametrize("run", [cudnn_conv_one_epilogue, cudnn_conv_benchmarked_one_epilogue])
def test_a_c2f_style_layer_with_residual_and_silu(run):
    g = torch.Generator().manual_seed(5)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], {"pads": [1, 1, 1, 1], "strides": [2, 2],
                                                           "activation": "Silu"}, domain="kiln")
    x = torch.randn(2, 8, 9, 9, generator=g).to(memory_format=torch.channels_last)
    w = torch.randn(16, 8, 3, 3, generator=g).to(memory_format=torch.channels_last)
    b, z = torch.randn(16, generator=g), torch.randn(2, 16, 5, 5, generator=g)
    assert not _applies(node, [x, w, b, z])  # CPU tensors: cuDNN's tactics are for the GPU
    torch.testing.assert_close(run(node, x, w, b, z), fused_conv(node, x, w, b, z), atol=1e-5, rtol=1e-5)


def test_an_onnx_conv_with_bias_alone():
    g = torch.Generator().manual_seed(6)
    node = Node("Conv", ["x", "w", "b"], ["y"], {"group": 4})
    x, w, b = torch.randn(1, 8, 4, 4, generator=g), torch.randn(12, 2, 1, 1, generator=g), torch.randn(12, generator=g)
    torch.testing.assert_close(cudnn_conv_one_epilogue(node, x, w, b), fused_conv(node, x, w, b), atol=1e-5, rtol=1e-5)
