import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv
from kiln.ops.fused import fused_conv

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TACTIC_TOL = 1e-2 if DEV == "cuda" else 1e-4  # tactic tests run FP32 as a "tf32" layer
SMALL = conv.TileConfig(16, 16, 16, 4, 1, group_m=2)  # several pixel and channel tiles, channel remainders
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _node(k, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act="", params=(), group=1, auto_pad=None):
    attrs = {"kernel_shape": [k, k], "strides": list(strides), "pads": list(pads), "dilations": list(dilations),
             "group": group, "activation": act, "activation_params": list(params)}
    if auto_pad:
        attrs["auto_pad"] = auto_pad
        del attrs["pads"]
    return Node("FusedConv", ["x", "w", "b", "z"], ["y"], attrs, domain="kiln")


CASES = {
    # name: (C, OC, node, residual, channels-last x)
    "3x3_pad1_relu_residual": (5, 7, _node(3, pads=(1, 1, 1, 1), act="Relu"), True, False),  # flat K (C < 32)
    "3x3_stride2_channels_last": (40, 9, _node(3, strides=(2, 2), pads=(1, 1, 1, 1)), False, True),  # C blocks
    "1x1_residual_relu": (33, 17, _node(1, act="Relu"), True, True),
    "dilated_asymmetric_pads": (3, 11, _node(3, strides=(2, 1), pads=(1, 0, 2, 1), dilations=(2, 2),
                                             act="LeakyRelu", params=[0.1]), False, False),
    "same_upper_7x7_stem": (3, 16, _node(7, strides=(2, 2), auto_pad="SAME_UPPER", act="Relu"), False, True),
    "nchw_x_many_channels": (48, 20, _node(3, pads=(0, 1, 0, 1), act="Silu"), True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    C, OC, node, residual, cl = CASES[case]
    x, w, b = _rand(2, C, 5, 7, seed=1), _rand(OC, C, *node.attr("kernel_shape"), seed=2), _rand(OC, seed=3)
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    oh, ow = conv.geometry(node, x, w)[3]
    z = _rand(2, OC, oh, ow, seed=4) if residual else None
    assert conv.supports(node, x, w, b, z)
    y = conv.conv2d(node, x, w, b, z, config=SMALL)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, conv.reference(node, x, w, b, z), atol=1e-4, rtol=1e-4)


def test_no_bias_and_a_broadcast_residual():
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    x, w = _rand(1, 36, 5, 7, seed=5), _rand(12, 36, 3, 3, seed=6)
    z = _rand(1, 12, 1, 7, seed=7)  # broadcast over rows: read with stride 0
    assert conv.supports(node, x, w, None, z)
    torch.testing.assert_close(conv.conv2d(node, x, w, None, z, config=SMALL), conv.reference(node, x, w, None, z),
                               atol=1e-4, rtol=1e-4)


def test_fp16_inputs():
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    x, w, b = _rand(1, 32, 5, 7, seed=8, dtype=torch.float16), _rand(9, 32, 3, 3, seed=9, dtype=torch.float16), \
        _rand(9, seed=10, dtype=torch.float16)
    y = conv.conv2d(node, x, w, b, None, config=SMALL)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, conv.reference(node, x, w, b), atol=2e-2, rtol=2e-2)


def test_every_output_element_is_written():
    C, OC, node, _, _ = CASES["3x3_stride2_channels_last"]
    x, w, b = _rand(2, C, 5, 7, seed=11), _rand(OC, C, 3, 3, seed=12), _rand(OC, seed=13)
    oh, ow = conv.geometry(node, x, w)[3]
    out = torch.full((2, oh, ow, OC), float("nan"), device=DEV)
    y = conv.conv2d(node, x, w, b, None, config=SMALL, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    torch.testing.assert_close(y, conv.reference(node, x, w, b), atol=1e-4, rtol=1e-4)


def test_supports_refuses_what_the_kernel_cannot_do():
    x, w, b = torch.randn(1, 4, 5, 7), torch.randn(6, 4, 3, 3), torch.randn(6)
    node = _node(3, pads=(1, 1, 1, 1))
    assert conv.supports(node, x, w, b, None)
    assert not conv.supports(_node(3, group=2), x, torch.randn(6, 2, 3, 3), b, None)  # grouped
    assert not conv.supports(node, torch.randn(1, 4, 5), torch.randn(6, 4, 3), b, None)  # 1-D
    assert not conv.supports(node, torch.randn(1, 4, 5, 7, 3), torch.randn(6, 4, 3, 3, 3), b, None)  # 3-D
    assert not conv.supports(node, x.half(), w, b, None)  # mixed dtypes
    assert not conv.supports(node, x.double(), w.double(), b, None)
    assert not conv.supports(node, x, w, b, torch.randn(1, 6, 4, 7))  # residual not broadcastable to the output
    assert not conv.supports(_node(3, act="Softplus"), x, w, b, None)
    assert not conv.supports(_node(9), x, torch.randn(6, 4, 9, 9), b, None)  # empty output


def _conv_tactics():
    from kiln.tactics import _TACTICS, triton_gemm  # noqa: F401  (registers)

    return [t for t in _TACTICS[("kiln", "FusedConv")] if t.name.startswith("triton_conv_")]


def test_every_tactic_matches_the_layer_reference():
    tactics = _conv_tactics()
    assert 2 <= sum(t.level == 4 for t in tactics) <= 3 and len({t.name for t in tactics}) == len(tactics)
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    node.precision = "tf32"
    x = _rand(1, 8, 5, 7, seed=14).to(memory_format=torch.channels_last)  # flat K: 72
    w, b, z = _rand(70, 8, 3, 3, seed=15), _rand(70, seed=16), _rand(1, 70, 5, 7, seed=17)
    want = fused_conv(node, x, w, b, z)
    tried = 0
    for t in tactics:
        ok = t.applies(node, [x, w, b, z])
        assert not ok or x.is_cuda, t.name  # CPU tensors are refused; the interpreter runs every config
        if ok or not x.is_cuda:
            torch.testing.assert_close(t.fn(node, x, w, b, z), want, atol=TACTIC_TOL, rtol=TACTIC_TOL, msg=t.name)
            tried += 1
    assert tried >= 2


@pytest.mark.parametrize("config", conv.NARROW_CONFIGS, ids=lambda c: c.name)
def test_narrow_tiles_run_a_zero_padded_rgb_stem(config):
    """The few-channel tiles on MobileNetV3's stem: 3x3 stride 2 over an image given a zero fourth channel
    (builder/layout.py), 16 filters, HardSwish; K = 36 walked flat in BLOCK_K slices."""
    node = _node(3, strides=(2, 2), pads=(1, 1, 1, 1), act="HardSwish")
    x = _rand(2, 4, 9, 10, seed=8).to(memory_format=torch.channels_last)
    w = _rand(16, 4, 3, 3, seed=9).to(memory_format=torch.channels_last)
    b = _rand(16, seed=10)
    assert conv.supports(node, x, w, b, None) and conv.block_k_for(config, 4)[1]  # flat
    torch.testing.assert_close(conv.conv2d(node, x, w, b, config=config), conv.reference(node, x, w, b),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", conv.FEW_ROWS_POINTWISE_CONFIGS, ids=lambda c: c.name)
def test_few_rows_tiles_run_a_squeeze_excite_fc(config):
    """A squeeze-excite block's second FC: a 1x1 convolution of the pooled [N, 6, 1, 1] map to 20 channels, Sigmoid
    in the epilogue, as a GEMM over the batch's rows."""
    node = _node(1, act="Sigmoid")
    x, w, b = _rand(3, 6, 1, 1, seed=11), _rand(20, 6, 1, 1, seed=12), _rand(20, seed=13)
    assert conv.is_pointwise(node, x, w, None)
    y = conv.pointwise_as_gemm(node, x, w, b, config=config)
    assert y.shape == (3, 20, 1, 1)
    torch.testing.assert_close(y, conv.reference(node, x, w, b), atol=1e-4, rtol=1e-4)
