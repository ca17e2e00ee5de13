"""The warp-specialized Gluon convolution (kernels/ws_conv.py): which layers it takes (CPU), its tactics, and on a
Hopper GPU its output against tma_conv's (the same arithmetic, but with 1 / y_scale folded into the column vectors:
the same codes but at rounding ties; tma_conv is tested against the FP32 reference and conv.py under the
interpreter). Triton's interpreter does not run Gluon; test_gluon_compile.py compiles every tile for sm_90 on the
CPU."""

import pytest
import torch

from kiln import tactics
from kiln.ir.graph import Node
from kiln.kernels import conv, tma_conv, ws_conv
from kiln.kernels.ws_conv import CONFIGS, WsConfig

from .util import assert_same_codes_but_ties, poisoned

FP8 = torch.float8_e4m3fn
WIDE = WsConfig(8, 8, 128, 128, 4, 2)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _node(k=3, pads=(1, 1, 1, 1), act="Relu", qtype="int8", stride=1):
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": list(pads), "dilations": [1, 1], "group": 1,
             "activation": act, "activation_params": [], "qtype": qtype}
    return Node("QConv", ["x", "w", "b", "z"], ["y"], attrs, domain="kiln")


def _layer(c, oc, hw, k=3, qtype="int8", device="cpu", seed=0):
    """8-bit channels-last x [2, c, *hw] and w [oc, c, k, k], per-channel weight scales, a bias."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.int8 if qtype == "int8" else FP8
    x = (torch.randn(2, c, *hw, generator=g) * 30).round().clamp(-128, 127)
    w = (torch.randn(oc, c, k, k, generator=g) * 30).round().clamp(-127, 127)
    if qtype == "fp8":
        x, w = x / 8, w / 8
    cl = dict(device=device, memory_format=torch.channels_last)
    sw = (torch.rand(oc, generator=g) * 1e-3 + 1e-4).to(device)
    return (x.to(dt).to(**cl), w.to(dt).to(**cl), torch.tensor(0.05, device=device), sw,
            torch.randn(oc, generator=g).half().to(device))


def test_the_layers_it_takes():
    x, w, _, _, b = _layer(128, 128, (7, 9))
    ys = torch.tensor(0.03)
    assert ws_conv.layer_ok(_node(), x, w, b, None, ys, None, WIDE)
    assert ws_conv.layer_ok(_node(act="", qtype="int8"), x, w, None, None, ys, None, WIDE)
    assert ws_conv.layer_ok(_node(stride=2), *_layer(128, 128, (8, 10))[:2], b, None, ys, None, WIDE)
    assert not ws_conv.supports(_node(), x, w, b, None, ys, None, WIDE)  # on the CPU: not offered
    refused = {
        "float output": (_node(), x, w, b, None, None, None),
        "an 8-bit copy": (_node(), x, w, b, None, ys, ys),
        "a residual": (_node(), x, w, b, torch.zeros(2, 128, 7, 9, dtype=torch.int8), ys, None),
        "SiLU": (_node(act="Silu"), x, w, b, None, ys, None),
        "OC not a whole tile": (_node(), x, w[:64], b[:64], None, ys, None),
        "NCHW input": (_node(), x.contiguous(), w, b, None, ys, None),
        "stride 2 over an odd map": (_node(stride=2), x, w, b, None, ys, None),
        "a float layer": (Node("FusedConv", ["x", "w"], ["y"], _node().attrs, domain="kiln"), x, w, b, None, ys,
                          None),
        # RepVGG's 96 channels: a 96-byte K box row has no swizzled shared layout (box_fits)
        "96 input channels": (_node(), *_layer(96, 128, (7, 9))[:2], b, None, ys, None),
    }
    for why, args in refused.items():
        assert not ws_conv.layer_ok(*args, WIDE), why


def test_resident_weights_take_one_channel_tile_of_a_small_filter():
    resident = WsConfig(8, 16, 64, 128, 4, 2, True)
    ys = torch.tensor(0.03)
    x, w, _, _, b = _layer(64, 64, (7, 9))
    assert ws_conv.layer_ok(_node(), x, w, b, None, ys, None, resident)  # 36 KB of 3x3 64 -> 64 filter
    x, w, _, _, b = _layer(64, 128, (7, 9))
    assert not ws_conv.layer_ok(_node(), x, w, b, None, ys, None, resident)  # two channel tiles
    x, w, _, _, b = _layer(128, 64, (7, 9))
    assert not ws_conv.layer_ok(_node(), x, w, b, None, ys, None, resident)  # a 72 KB filter
    assert resident.name == "8x16x64x128_s4_x2_rw"


def test_its_tactics_are_registered_and_refuse_cpu_tensors():
    node = _node()
    tactics.load_all()
    ours = [t for t in tactics.candidates(node) if t.name.startswith("gluon_ws_qconv_")]
    assert {t.name for t in ours} == {f"gluon_ws_qconv_{cfg.name}" for cfg, _ in CONFIGS}
    x, w, sx, sw, b = _layer(128, 128, (7, 9))
    assert not any(t.applies(node, [x, w, sx, sw, b, None, torch.tensor(0.03)]) for t in ours)


def _cases():
    for cfg, _ in CONFIGS:
        c = cfg.block_n  # 64-wide tiles are layer1's: 64 channels, K tiles of 64
        oc = cfg.block_n if cfg.resident_weights else 2 * cfg.block_n  # resident weights: one channel tile
        for qtype in ("int8", "fp8"):
            yield cfg, qtype, 1, (1, 1, 1, 1), "Relu", c, oc
        yield cfg, "int8", 2, (1, 1, 1, 1), "Relu", c, oc
    yield WIDE, "int8", 1, (0, 2, 1, 0), "", 256, 256  # asymmetric pads, no activation, two K tiles a tap
    yield WIDE, "fp8", 2, (2, 3, 0, 1), "", 128, 256  # every phase of the strided view


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("cfg, qtype, stride, pads, act, c, oc", list(_cases()), ids=str)
def test_it_matches_tma_conv(cfg, qtype, stride, pads, act, c, oc):
    node = _node(3, pads, act, qtype, stride)
    hw = (7, 9) if stride == 1 else (8, 10)  # ragged patches; strided: even H and W
    x, w, sx, sw, b = _layer(c, oc, hw, qtype=qtype, device="cuda")
    ys = torch.tensor(0.03 if qtype == "int8" else 0.5, device="cuda")
    assert ws_conv.supports(node, x, w, b, None, ys, None, cfg)
    got = poisoned(lambda: ws_conv.conv2d(node, x, w, b, cfg, sx, sw, ys))
    want = tma_conv.conv2d(node, x, w, b, config=cfg.patch, x_scale=sx, w_scale=sw, y_scale=ys)
    assert got.shape == want.shape == (2, oc, *conv.geometry(node, x, w)[3])
    assert got.dtype == want.dtype and got.is_contiguous(memory_format=torch.channels_last)
    assert_same_codes_but_ties(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
def test_float_input_is_quantized_first():
    node = _node()
    _, w, sx, sw, b = _layer(128, 128, (7, 9), device="cuda")
    x = torch.randn(2, 128, 7, 9, device="cuda").half().to(memory_format=torch.channels_last)
    ys = torch.tensor(0.03, device="cuda")
    want = tma_conv.conv2d(node, x, w, b, config=WIDE.patch, x_scale=sx, w_scale=sw, y_scale=ys)
    assert_same_codes_but_ties(ws_conv.conv2d(node, x, w, b, WIDE, sx, sw, ys), want)
