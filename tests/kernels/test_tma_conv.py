"""The TMA convolution (kernels/tma_conv.py) against the FP32 reference and conv.py's quantized kernel, under
TRITON_INTERPRET=1 on the CPU (the interpreter runs 4-D tensor descriptors, zero-filling boxes past the image's
edge, negative coordinates included)."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv, tma_conv
from kiln.kernels.tma_conv import PatchConfig

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = PatchConfig(4, 4, 16, 16, 4, 2)  # 7x9 maps span ragged patches; 32 channels: two K tiles per tap
SMALL8 = PatchConfig(4, 4, 16, 32, 4, 2)  # 8-bit Tensor Cores sum 32 values a step; 64 channels: two K tiles
FP8 = torch.float8_e4m3fn


def _node(k, pads, act="", qtype="", stride=1):
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": list(pads), "dilations": [1, 1], "group": 1,
             "activation": act, "activation_params": []}
    if qtype:
        attrs["qtype"] = qtype
    return Node("QConv" if qtype else "FusedConv", ["x", "w", "b", "z"], ["y"], attrs, domain="kiln")


def _cl(t):
    return t.to(DEV).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("k, pads, act, residual, stride", [
    (3, (1, 1, 1, 1), "Relu", True, 1),  # ResNet's 3x3: the border reads zeros on all four sides
    (3, (0, 2, 1, 0), "", False, 1),  # asymmetric pads: a wider output than input
    (1, (0, 0, 0, 0), "Silu", False, 1),
    (3, (1, 1, 1, 1), "Relu", True, 2),  # ResNet's strided 3x3: boxes of the [N, H/2, 2, W/2, 2C] view
    (1, (0, 0, 0, 0), "", False, 2),  # ResNet's downsample
    (3, (2, 3, 0, 1), "", False, 2),  # odd and even pads: every phase of the view
])
@pytest.mark.parametrize("config", [SMALL, PatchConfig(1, 16, 16, 16, 4, 2)])  # 4x4 and one-row patches
def test_float_conv_matches_the_reference(k, pads, act, residual, stride, config):
    g = torch.Generator().manual_seed(k)
    node = _node(k, pads, act, stride=stride)
    hw = (7, 9) if stride == 1 else (8, 10)  # strided: even H and W
    x = _cl(torch.randn(2, 32, *hw, generator=g).half())
    w = _cl((torch.randn(48, 32, k, k, generator=g) / 8).half())
    b = torch.randn(48, generator=g).half().to(DEV)
    oh, ow = conv.geometry(node, x, w)[3]
    z = _cl(torch.randn(2, 48, oh, ow, generator=g).half()) if residual else None
    assert tma_conv.supports(node, x, w, b, z, config)
    y = poisoned(lambda: tma_conv.conv2d(node, x, w, b, z, config=config))
    assert y.shape == (2, 48, oh, ow) and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.float(), conv.reference(node, x, w, b, z).float(), atol=2e-3, rtol=2e-3)


def _int8_layer(seed, qtype="int8"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 64, 7, 9, generator=g) * 30).round().clamp(-128, 127)
    w = (torch.randn(48, 64, 3, 3, generator=g) * 30).round().clamp(-127, 127)
    dt = torch.int8 if qtype == "int8" else FP8
    sw = (torch.rand(48, generator=g) * 0.01 + 0.001).to(DEV)
    return _cl(x.to(dt)), _cl(w.to(dt)), torch.tensor(0.05, device=DEV), sw, torch.randn(48, generator=g).half().to(DEV)


@pytest.mark.parametrize("outputs", ["float", "int8", "float and int8 copy", "int8 from an int8 residual",
                                     "int8 and int8 copy"])
def test_int8_conv_matches_the_pointer_kernel(outputs):
    # conv.py's quantized convolution is the tested reference: identical integer sums, the same FP32 epilogue
    node = _node(3, (1, 1, 1, 1), "Relu", qtype="int8")
    x, w, sx, sw, b = _int8_layer(1)
    z = _cl(torch.randn(2, 48, 7, 9).half())
    if "residual" in outputs:  # a block output written once as int8, scaled back in the epilogue
        z = _cl((torch.randn(2, 48, 7, 9) * 40).round().clamp(-128, 127).to(torch.int8))
    kw = dict(x_scale=sx, w_scale=sw, out_dtype=torch.float16,
              z_scale=torch.tensor(0.02, device=DEV) if "residual" in outputs else None,
              y_scale=torch.tensor(0.03, device=DEV) if outputs.startswith("int8") else None,
              q_scale=torch.tensor(0.02, device=DEV) if "copy" in outputs else None)
    assert tma_conv.supports(node, x, w, b, z, SMALL8, "int8")
    assert not tma_conv.supports(node, x, w, b, z, SMALL, "int8")  # 16-value K tiles: too short for 8-bit dots
    got = poisoned(lambda: tma_conv.conv2d(node, x, w, b, z, config=SMALL8, **kw))
    want = conv.conv2d(node, x, w, b, z, config=conv.TileConfig(16, 16, 32, 4, 2), **kw)
    for g_, w_ in zip(*(((t,) if isinstance(t, torch.Tensor) else t) for t in (got, want))):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)


@pytest.mark.parametrize("kernel, pads, stride, hw", [
    ((3, 3), (1, 1, 1, 1), 2, (8, 10)),  # ResNet's strided 3x3
    ((4, 1), (2, 0, 1, 0), 1, (8, 9)),  # passes/stem_patches.py's stem: 4x1 taps over 64 channels of 8-bit patches
])
def test_strided_and_stem_int8_convs_match_the_pointer_kernel(kernel, pads, stride, hw):
    node = _node(kernel[0], pads, "Relu", qtype="int8", stride=stride)
    node.attrs["kernel_shape"] = list(kernel)
    g = torch.Generator().manual_seed(4)
    x = _cl((torch.randn(2, 64, *hw, generator=g) * 30).round().clamp(-128, 127).to(torch.int8))
    w = _cl((torch.randn(48, 64, *kernel, generator=g) * 30).round().clamp(-127, 127).to(torch.int8))
    kw = dict(x_scale=torch.tensor(0.05, device=DEV), w_scale=(torch.rand(48, generator=g) * 0.01 + 0.001).to(DEV),
              y_scale=torch.tensor(0.03, device=DEV))
    assert tma_conv.supports(node, x, w, None, None, SMALL8, "int8")
    got = poisoned(lambda: tma_conv.conv2d(node, x, w, config=SMALL8, **kw))
    assert got.shape == (2, 48, *conv.geometry(node, x, w)[3])
    assert torch.equal(got, conv.conv2d(node, x, w, config=conv.TileConfig(16, 16, 32, 4, 2), **kw))


def test_fp8_conv_and_float_input_quantized_first():
    node = _node(3, (1, 1, 1, 1), qtype="fp8")
    _, w, sx, sw, b = _int8_layer(2, "fp8")
    x = _cl(torch.randn(2, 64, 7, 9).half())  # floats: quantized by one pass before the kernel
    kw = dict(x_scale=sx, w_scale=sw, out_dtype=torch.float16)
    torch.testing.assert_close(tma_conv.conv2d(node, x, w, b, config=SMALL8, **kw),
                               conv.conv2d(node, x, w, b, config=conv.TileConfig(16, 16, 32, 4, 2), **kw),
                               atol=1e-3, rtol=1e-3)


def test_what_a_box_cannot_read_is_refused():
    node = _node(3, (1, 1, 1, 1))
    x, w = _cl(torch.randn(1, 32, 6, 6).half()), _cl(torch.randn(16, 32, 3, 3).half())
    assert tma_conv.supports(node, x, w, None, None, SMALL)
    strided = Node("FusedConv", ["x", "w"], ["y"], {**node.attrs, "strides": [2, 2]}, domain="kiln")
    assert tma_conv.supports(strided, x, w, None, None, SMALL)
    odd_map = _cl(torch.randn(1, 32, 7, 6).half())  # stride 2 over 7 rows: the view needs even H and W
    assert not tma_conv.supports(strided, odd_map, w, None, None, SMALL)
    three = Node("FusedConv", ["x", "w"], ["y"], {**node.attrs, "strides": [3, 3]}, domain="kiln")
    assert not tma_conv.supports(three, _cl(torch.randn(1, 32, 9, 9).half()), w, None, None, SMALL)
    assert not tma_conv.supports(node, x.contiguous(), w, None, None, SMALL)  # NCHW x
    assert not tma_conv.supports(node, x, w.contiguous(), None, None, SMALL)  # NCHW weights: not K-major
    odd = _cl(torch.randn(1, 24, 6, 6).half())  # 24 channels: a 16-channel K tile would straddle taps
    assert not tma_conv.supports(node, odd, _cl(torch.randn(16, 24, 3, 3).half()), None, None, SMALL)
    assert not tma_conv.supports(node, x.float(), w.float(), None, None, SMALL)  # FP32: not a TMA tactic
    assert not tma_conv.supports(node, x, _cl(torch.randn(8, 32, 3, 3).half()), None, None, SMALL)  # OC % 16
