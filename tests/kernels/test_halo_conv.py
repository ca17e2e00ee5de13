"""The row-halo Gluon 3x3 convolution (kernels/halo_conv.py): which layers it takes (CPU), its tactic, and on a
Hopper GPU its output against tma_conv's (tested under the interpreter): the same codes but for values at a rounding
tie, one step away (1 / y_scale folded into the column vectors; FP8 also sums the taps in another order).
test_gluon_compile.py compiles the kernel for sm_90 on the CPU."""

import pytest
import torch

from kiln import tactics
from kiln.kernels import conv, halo_conv, tma_conv
from kiln.kernels.tma_conv import PatchConfig

from .test_ws_conv import HOPPER, _layer, _node
from .util import assert_same_codes_but_ties, poisoned


def test_the_layers_it_takes():
    x, w, _, _, b = _layer(64, 64, (56, 56))
    s = torch.tensor(0.03)
    assert halo_conv.layer_ok(_node(), x, w, b, None, s, None)
    assert halo_conv.layer_ok(_node(act=""), x, w, None, None, s, None)
    assert not halo_conv.supports(_node(), x, w, b, None, s, None)  # on the CPU: not offered
    wide, _, _, _, _ = _layer(64, 64, (8, 72))
    refused = {
        "float output": (_node(), x, w, b, None, None, None),
        "an 8-bit copy": (_node(), x, w, b, None, s, s),
        "a residual": (_node(), x, w, b, torch.zeros_like(x), s, None),
        "SiLU": (_node(act="Silu"), x, w, b, None, s, None),
        "stride 2": (_node(stride=2), x, w, b, None, s, None),
        "pad 0": (_node(pads=(0, 0, 0, 0)), x, w, b, None, s, None),
        "a 1x1 filter": (_node(k=1, pads=(0, 0, 0, 0)), x, w[:, :, :1, :1].contiguous(
            memory_format=torch.channels_last), b, None, s, None),
        "128 output channels": (_node(), x, torch.cat([w, w]), torch.cat([b, b]), None, s, None),
        "wider than 64 pixels": (_node(), wide, w, b, None, s, None),
        "NCHW input": (_node(), x.contiguous(), w, b, None, s, None),
    }
    for why, args in refused.items():
        assert not halo_conv.layer_ok(*args), why


def test_its_tactic_is_registered_and_refuses_cpu_tensors():
    node = _node()
    tactics.load_all()
    ours = [t for t in tactics.candidates(node) if t.name == "gluon_halo_qconv3x3"]
    assert len(ours) == 1
    x, w, sx, sw, b = _layer(64, 64, (56, 56))
    assert not ours[0].applies(node, [x, w, sx, sw, b, None, torch.tensor(0.03), None, None])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("qtype, hw, act, bias", [("int8", (56, 56), "Relu", True), ("fp8", (56, 56), "Relu", True),
                                                  ("int8", (9, 64), "", False), ("fp8", (7, 13), "", True)], ids=str)
def test_it_matches_tma_conv(qtype, hw, act, bias):
    """56 x 56: layer1; 9 rows: a last tile with one row; 64 wide: a whole box row; 13 wide: most of it past W."""
    node = _node(act=act, qtype=qtype)
    x, w, sx, sw, b = _layer(64, 64, hw, qtype=qtype, device="cuda")
    b = b if bias else None
    ys = torch.tensor(0.03 if qtype == "int8" else 0.5, device="cuda")
    assert halo_conv.supports(node, x, w, b, None, ys, None)
    got = poisoned(lambda: halo_conv.conv2d(node, x, w, b, sx, sw, ys))
    want = tma_conv.conv2d(node, x, w, b, config=PatchConfig(8, 8, 64, 64, 4, 2), x_scale=sx, w_scale=sw, y_scale=ys)
    assert got.shape == want.shape == (2, 64, *conv.geometry(node, x, w)[3])
    assert got.dtype == want.dtype and got.is_contiguous(memory_format=torch.channels_last)
    assert_same_codes_but_ties(got, want)
