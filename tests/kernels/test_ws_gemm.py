"""The warp-specialized Gluon GEMM (kernels/ws_gemm.py) for 1x1 convolutions and QGemm layers: which layers it takes
(CPU), its tactics, and on a Hopper GPU its output against tma_gemm's (the same arithmetic, but with 1 / y_scale
folded into the column vectors: the same codes but at rounding ties; its GELU in the tanh form by the SFU's tanh;
tma_gemm is tested under the interpreter). Triton's interpreter does not run
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


def _gemm_node(act="GeluErf", qtype="fp8"):
    return Node("QGemm", ["x", "w", "xs", "ws", "b", "ys"], ["y"], {"qtype": qtype, "activation": act}, domain="kiln")


def _gemm_layer(k, n, qtype="fp8", device="cpu", seed=0):
    """8-bit x [2, 72, k] (row-major) and w [k, n] (K-major, as the engine stores a QGemm's weights), x and w scales
    putting x @ w near N(0, 1), a bias."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.int8 if qtype == "int8" else FP8

    def codes(*shape):
        return (torch.randn(*shape, generator=g) * 40).round().clamp(-127, 127).to(dt).to(device)

    return (codes(2, 72, k), codes(n, k).t(), torch.tensor(2.5 / 100, device=device),
            torch.tensor(2.5 / 100 / k ** 0.5, device=device), torch.randn(n, generator=g).half().to(device))


def test_the_gemm_layers_it_takes():
    x, w, _, _, b = _gemm_layer(256, 256)
    s = torch.tensor(0.03)
    for act in ("GeluErf", "GeluTanh", "Relu", ""):
        assert ws_gemm.layer_ok(_gemm_node(act), x, w, b, None, s, None, None, WIDE), act
    refused = {
        "SiLU": (_gemm_node("Silu"), x, w, b),
        "row-major weights": (_gemm_node(), x, w.contiguous(), b),
        "a strided x": (_gemm_node(), x[:, ::2], w, b),
        "N not a whole tile": (_gemm_node(), x, w[:, :64], b[:64]),
        "K of 48": (_gemm_node(), x[..., :48], w[:48], b),
    }
    for why, (node, *args) in refused.items():
        assert not ws_gemm.layer_ok(node, *args, None, s, None, None, WIDE), why
    assert not ws_gemm.layer_ok(_gemm_node(), x, w, b, None, None, None, None, WIDE), "float output"


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
        "a GELU before a residual": (_node(act="GeluErf"), x, w, b, z, s, None, s),
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
    gemm_ours = [t for t in tactics.candidates(_gemm_node()) if t.name.startswith("gluon_ws_qgemm_")]
    assert {t.name for t in gemm_ours} == {f"gluon_ws_qgemm_{cfg.name}" for cfg, _ in CONFIGS}
    x, w, sx, sw, b = _gemm_layer(256, 256)
    assert not any(t.applies(_gemm_node(), [x, w, sx, sw, b, s]) for t in gemm_ours)


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
    got = poisoned(lambda: ws_gemm.matmul8(node, x, w, b, z, cfg, sx, sw, ys, zs))
    want = tma_gemm.gemm(pixel_rows(x), w.reshape(oc, c).t(), b, act, config=TileConfig(64, 128, 64, 4, 2),
                         qtype=qtype, x_scale=sx, w_scale=sw, y_scale=ys, z=pixel_rows(z) if residual else None,
                         z_scale=zs)
    assert got.shape == (2, oc, 9, 15) and got.is_contiguous(memory_format=torch.channels_last)
    assert_same_codes_but_ties(pixel_rows(got), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("cfg", [cfg for cfg, _ in CONFIGS], ids=str)
@pytest.mark.parametrize("qtype, act", [("fp8", "GeluErf"), ("int8", "GeluTanh"), ("fp8", "")])
def test_a_gemm_layer_matches_tma_gemm(cfg, qtype, act):
    """A QGemm (three K tiles; 144 rows: a ragged last row tile) against tma_gemm with the tanh-form GELU, whose
    sigmoid form and the SFU's tanh can put a value on the other side of a rounding tie."""
    node = _gemm_node(act, qtype)
    n = 2 * cfg.block_n
    x, w, sx, sw, b = _gemm_layer(384, n, qtype, "cuda")
    ys = torch.tensor(0.02 if qtype == "int8" else 0.25, device="cuda")
    assert ws_gemm.supports(node, x, w, b, None, ys, None, None, cfg)
    got = poisoned(lambda: ws_gemm.matmul8(node, x, w, b, None, cfg, sx, sw, ys))
    want = tma_gemm.gemm(x, w, b, "GeluTanh" if act else "", config=TileConfig(64, 128, 64, 4, 2), qtype=qtype,
                         x_scale=sx, w_scale=sw, y_scale=ys)
    assert got.shape == (2, 72, n)
    assert_same_codes_but_ties(got, want, rare=1e-2)
