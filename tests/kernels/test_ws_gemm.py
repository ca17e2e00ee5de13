"""The warp-specialized Gluon 1x1 convolution (kernels/ws_gemm.py): which layers it takes (CPU), its tactics, and on a
Hopper GPU its output against tma_gemm's (the same arithmetic, but with 1 / y_scale folded into the column vectors:
the same codes but at rounding ties; tma_gemm is tested under the interpreter). Triton's interpreter does not run
Gluon; test_gluon_compile.py compiles every tile for sm_90 on the CPU."""

import pytest
import torch

from kiln import tactics
from kiln.ir.graph import Node
from kiln.kernels import tma_gemm, ws_gemm
from kiln.kernels.conv import pixel_rows
from kiln.kernels.gemm import TileConfig
from kiln.kernels.ws_gemm import CONFIGS, WsGemmConfig

from .util import assert_same_codes_but_ties, poisoned

FP8 = torch.float8_e4m3fn
WIDE = WsGemmConfig(128, 128, 2, 2)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _node(act="Relu", qtype="int8", stride=1):
    attrs = {"kernel_shape": [1, 1], "strides": [stride, stride], "pads": [0, 0, 0, 0], "dilations": [1, 1],
             "group": 1, "activation": act, "activation_params": [], "qtype": qtype}
    return Node("QConv", ["x", "w", "b", "z"], ["y"], attrs, domain="kiln")


def _layer(c, oc, hw, qtype="int8", device="cpu", residual=True, seed=0):
    """8-bit channels-last x [2, c, *hw], w [oc, c, 1, 1] and residual z [2, oc, *hw]; per-channel weight scales,
    a bias."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.int8 if qtype == "int8" else FP8

    def codes(*shape):
        v = (torch.randn(*shape, generator=g) * 30).round().clamp(-127, 127)
        return (v if qtype == "int8" else v / 8).to(dt).to(device=device, memory_format=torch.channels_last)

    sw = (torch.rand(oc, generator=g) * 1e-3 + 1e-4).to(device)
    return (codes(2, c, *hw), codes(oc, c, 1, 1), codes(2, oc, *hw) if residual else None,
            torch.tensor(0.05, device=device), sw, torch.randn(oc, generator=g).half().to(device))


def test_the_layers_it_takes():
    x, w, z, _, _, b = _layer(64, 128, (7, 9))
    s = torch.tensor(0.03)
    assert ws_gemm.layer_ok(_node(), x, w, b, z, s, None, s, WIDE)
    assert ws_gemm.layer_ok(_node(act=""), x, w, None, None, s, None, None, WIDE)
    assert not ws_gemm.supports(_node(), x, w, b, z, s, None, s, WIDE)  # on the CPU: not offered
    refused = {
        "float output": (_node(), x, w, b, z, None, None, s),
        "an 8-bit copy": (_node(), x, w, b, z, s, s, s),
        "a float residual": (_node(), x, w, b, z.float(), s, None, s),
        "a residual without its scale": (_node(), x, w, b, z, s, None, None),
        "SiLU": (_node(act="Silu"), x, w, b, z, s, None, s),
        "stride 2": (_node(stride=2), x, w, b, None, s, None, None),
        "N not a whole tile": (_node(), x, w[:64], b[:64], None, s, None, None),
        "K of 48": (_node(), x[:, :48], w[:, :48], b, None, s, None, None),
        "NCHW input": (_node(), x.contiguous(), w, b, z, s, None, s),
        "a float layer": (Node("FusedConv", ["x", "w"], ["y"], _node().attrs, domain="kiln"), x, w, b, z, s, None, s),
    }
    for why, args in refused.items():
        assert not ws_gemm.layer_ok(*args, WIDE), why


def test_its_tactics_are_registered_and_refuse_cpu_tensors():
    node = _node()
    tactics.load_all()
    ours = [t for t in tactics.candidates(node) if t.name.startswith("gluon_ws_qconv1x1_")]
    assert {t.name for t in ours} == {f"gluon_ws_qconv1x1_{cfg.name}" for cfg, _ in CONFIGS}
    x, w, z, sx, sw, b = _layer(64, 128, (7, 9))
    s = torch.tensor(0.03)
    assert not any(t.applies(node, [x, w, sx, sw, b, z, s, None, s]) for t in ours)


def _cases():
    for cfg, _ in CONFIGS:
        for qtype in ("int8", "fp8"):
            yield cfg, qtype, 64, True, "Relu"
            yield cfg, qtype, 256, False, ""  # two K tiles of 128, no residual, no activation


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("cfg, qtype, c, residual, act", list(_cases()), ids=str)
def test_it_matches_tma_gemm(cfg, qtype, c, residual, act):
    node = _node(act, qtype)
    oc = 2 * cfg.block_n
    x, w, z, sx, sw, b = _layer(c, oc, (9, 15), qtype, "cuda", residual)  # 270 pixel rows: a ragged last row tile
    ys, zs = torch.tensor(0.03 if qtype == "int8" else 0.5, device="cuda"), torch.tensor(0.02, device="cuda")
    zs = zs if residual else None
    assert ws_gemm.supports(node, x, w, b, z, ys, None, zs, cfg)
    got = poisoned(lambda: ws_gemm.conv1x1(node, x, w, b, z, cfg, sx, sw, ys, zs))
    want = tma_gemm.gemm(pixel_rows(x), w.reshape(oc, c).t(), b, act, config=TileConfig(64, 128, 64, 4, 2),
                         qtype=qtype, x_scale=sx, w_scale=sw, y_scale=ys, z=pixel_rows(z) if residual else None,
                         z_scale=zs)
    assert got.shape == (2, oc, 9, 15) and got.is_contiguous(memory_format=torch.channels_last)
    assert_same_codes_but_ties(pixel_rows(got), want)
