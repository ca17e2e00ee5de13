import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv, depthwise_conv
from kiln.ops.fused import fused_conv

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = depthwise_conv.DepthwiseConfig(16, 16, 4)  # several pixel and channel blocks, channel remainders
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _node(c, k, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act="", params=()):
    return Node("FusedConv", ["x", "w", "b", "z"], ["y"],
                {"kernel_shape": [k, k], "strides": list(strides), "pads": list(pads), "dilations": list(dilations),
                 "group": c, "activation": act, "activation_params": list(params)}, domain="kiln")


CASES = {
    # name: (C, H, W, node, bias, residual, channels-last x)
    "3x3_relu_channels_last": (24, 6, 7, _node(24, 3, pads=(1, 1, 1, 1), act="Relu"), True, False, True),
    "5x5_stride2_hardswish": (20, 9, 8, _node(20, 5, strides=(2, 2), pads=(2, 2, 2, 2), act="HardSwish"), True,
                              False, True),
    "3x3_stride2_silu_nchw": (17, 7, 6, _node(17, 3, strides=(2, 2), pads=(1, 1, 1, 1), act="Silu"), True, False,
                              False),
    "dilated_asymmetric_residual_no_bias": (33, 6, 9, _node(33, 3, strides=(1, 2), pads=(2, 0, 1, 2),
                                                            dilations=(2, 1)), False, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(case):
    C, H, W, node, bias, residual, cl = CASES[case]
    x, w = _rand(2, C, H, W, seed=1), _rand(C, 1, *node.attr("kernel_shape"), seed=2)
    b = _rand(C, seed=3) if bias else None
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    oh, ow = conv.geometry(node, x, w)[3]
    z = _rand(2, C, oh, ow, seed=4) if residual else None
    assert depthwise_conv.supports(node, x, w, b, z)
    y = poisoned(lambda: depthwise_conv.conv2d(node, x, w, b, z, config=SMALL))
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, fused_conv(node, x, w, b, z), atol=1e-4, rtol=1e-4)


def test_fp16_sums_in_fp32():
    """16-bit operands, FP32 sums: as close to the FP32 result as one FP16 rounding of the output."""
    node = _node(32, 3, pads=(1, 1, 1, 1), act="Silu")
    x = _rand(2, 32, 8, 8, seed=5).half().to(memory_format=torch.channels_last)
    w, b = _rand(32, 1, 3, 3, seed=6).half(), _rand(32, seed=7).half()
    want = fused_conv(node, x.float(), w.float(), b.float())
    got = depthwise_conv.conv2d(node, x, w, b, config=depthwise_conv.CONFIGS[0])
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_only_one_filter_per_channel():
    """Grouped convolutions of several channels a group, channel multipliers and plain ones are not depthwise."""
    x = _rand(1, 8, 5, 5)
    assert not depthwise_conv.supports(_node(4, 3), x, _rand(8, 2, 3, 3), None, None)  # 2 channels a group
    assert not depthwise_conv.supports(_node(8, 3), x, _rand(16, 1, 3, 3), None, None)  # multiplier 2
    assert not depthwise_conv.supports(_node(1, 3), x, _rand(8, 8, 3, 3), None, None)
    assert not depthwise_conv.supports(_node(8, 9), _rand(1, 8, 9, 9), _rand(8, 1, 9, 9), None, None)  # 81 taps
