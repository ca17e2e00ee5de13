"""The INT8/FP8 Triton kernels (QGemm, QConv: quantize in the prologue, scales/bias/residual/activation in
the epilogue) against kiln.ops.fused.qgemm / qconv. Triton's interpreter without a GPU: small shapes."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv, gemm
from kiln.ops.fused import qconv, qgemm, quantize_int8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = gemm.TileConfig(16, 16, 32, 4, 1, group_m=2)  # several tiles; BLOCK_K 32, the 8-bit dot's minimum
FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype).to(DEV)


def _weights(*shape, seed=0, qtype="int8"):
    if qtype == "fp8":
        return torch.randn(*shape, generator=_gen(seed)).clamp(-3, 3).to(FP8).to(DEV)
    return torch.randint(-127, 128, shape, generator=_gen(seed), dtype=torch.int8).to(DEV)


def _scales(n, seed=0):
    return (torch.rand(n, generator=_gen(seed)) * 0.01 + 0.001).to(DEV)


def _on_fp8_grid(*shape, seed=0, sx=0.0625):
    """Activations that quantize exactly to E4M3 values (x / sx already on the grid), plus a few beyond
    +-448 * sx (saturated). Triton's interpreter casts FP32 -> float8e4nv by rounding ties away and
    drops mantissa carries, unlike the GPU's cvt.rn.satfinite; on the grid both are exact."""
    g = _gen(seed)
    x = (torch.randn(*shape, generator=g) * 40).to(FP8).float() * sx
    x.view(-1)[:3] = torch.tensor([1000.0, -1000.0, 449.0]) * sx
    return x.to(DEV)


def _qgemm_node(act="", params=(), qtype="int8"):
    return Node("QGemm", ["x", "w", "sx", "sw", "b"], ["y"],
                {"activation": act, "activation_params": list(params), "qtype": qtype}, domain="kiln")


def _qconv_node(k, strides=(1, 1), pads=(0, 0, 0, 0), act="", params=(), qtype="int8", group=1):
    return Node("QConv", ["x", "w", "sx", "sw", "b", "z"], ["y"],
                {"kernel_shape": [k, k], "strides": list(strides), "pads": list(pads), "dilations": [1, 1],
                 "group": group, "activation": act, "activation_params": list(params), "qtype": qtype}, domain="kiln")


# --- QGemm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("M, K, N, act, dtype", [
    (37, 70, 45, "Relu", torch.float32),  # K and N not multiples of the block sizes
    (5, 64, 17, "GeluTanh", torch.float32),  # K a multiple of BLOCK_K: the unmasked loop
    (33, 48, 24, "", torch.float16),
])
def test_qgemm_int8_matches_reference_into_a_poisoned_buffer(M, K, N, act, dtype):
    x, w, sw, b = _rand(M, K, seed=M, dtype=dtype), _weights(K, N, seed=K), _scales(N, seed=N), _rand(N, seed=1)
    sx = torch.tensor(0.023, device=DEV)  # not a power of two: x * (1/sx) may differ from x / sx by an ulp
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
    y = gemm.gemm(x, w, b, act, config=SMALL, out=out, qtype="int8", x_scale=sx, w_scale=sw)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, qgemm(_qgemm_node(act), x, w, sx, sw, b), atol=tol, rtol=tol)


def test_int8_quantization_rounds_half_to_even_and_saturates():
    sx = torch.tensor(0.0625, device=DEV)  # a power of two: x / sx exact, ties stay ties
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 127.5, -128.5, 300.0, -300.0])
    x = torch.cat([ties, torch.randn(20, generator=_gen(2)) * 50]).reshape(1, 32).repeat(3, 1).to(DEV) * sx
    eye = torch.eye(32, dtype=torch.int8, device=DEV)  # y = sx * q(x): the quantized values themselves
    y = gemm.gemm(x, eye, None, config=SMALL, qtype="int8", x_scale=sx, w_scale=torch.ones(1, device=DEV))
    want = qgemm(_qgemm_node(), x, eye, sx, torch.ones(1, device=DEV))
    assert (y / sx)[0, :12].tolist() == [0, 2, 2, 0, -2, -2, 126, -128, 127, -128, 127, -128]
    torch.testing.assert_close(y, want, atol=0, rtol=0)


def test_qgemm_fp8_matches_reference():
    M, K, N, sx = 19, 40, 33, torch.tensor(0.0625, device=DEV)
    x, w, sw, b = _on_fp8_grid(M, K, seed=3), _weights(K, N, seed=4, qtype="fp8"), _scales(1, seed=5), _rand(N, seed=6)
    out = torch.full((M, N), float("nan"), device=DEV)
    y = gemm.gemm(x, w, b, "Silu", config=SMALL, out=out, qtype="fp8", x_scale=sx, w_scale=sw)  # one weight scale
    assert torch.isfinite(out).all()
    torch.testing.assert_close(y, qgemm(_qgemm_node("Silu", qtype="fp8"), x, w, sx, sw, b), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_random_activations_round_like_the_reference_on_the_gpu(qtype):
    if qtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 dots need sm_89+")
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16) * 4
    w, sw, sx = _weights(256, 128, seed=7, qtype=qtype), _scales(128, seed=8), torch.tensor(0.0625, device="cuda")
    y = gemm.gemm(x, w, None, config=gemm.QUANT_CONFIGS[0][0], qtype=qtype, x_scale=sx, w_scale=sw)
    torch.testing.assert_close(y, qgemm(_qgemm_node(qtype=qtype), x, w, sx, sw), atol=2e-2, rtol=2e-2)


# --- QConv ----------------------------------------------------------------------------------
CASES = {
    # name: (C, OC, node, residual, channels-last x and w, x dtype)
    "3x3_pad1_relu_residual_flat_k": (5, 7, _qconv_node(3, pads=(1, 1, 1, 1), act="Relu"), True, False,
                                      torch.float32),
    "3x3_stride2_channel_blocks": (40, 9, _qconv_node(3, strides=(2, 2), pads=(1, 1, 1, 1)), False, True,
                                   torch.float32),
    "1x1_residual_relu_fp16": (33, 17, _qconv_node(1, act="Relu"), True, True, torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qconv_int8_matches_reference_into_a_poisoned_buffer(case):
    C, OC, node, residual, cl, dtype = CASES[case]
    x, w = _rand(2, C, 5, 7, seed=1, dtype=dtype), _weights(OC, C, *node.attr("kernel_shape"), seed=2)
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    sx, sw, b = torch.tensor(0.031, device=DEV), _scales(OC, seed=3), _rand(OC, seed=4)
    oh, ow = conv.geometry(node, x, w)[3]
    z = _rand(2, OC, oh, ow, seed=5, dtype=dtype) if residual else None
    assert conv.supports(node, x, w, b, z, "int8")
    out = torch.full((2, oh, ow, OC), float("nan"), dtype=dtype, device=DEV)
    y = conv.conv2d(node, x, w, b, z, config=SMALL, out=out, x_scale=sx, w_scale=sw)
    assert y.data_ptr() == out.data_ptr() and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.isfinite(out).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, qconv(node, x, w, sx, sw, b, z), atol=tol, rtol=tol)


@pytest.mark.parametrize("pointwise", [False, True])
def test_qconv_adds_an_8bit_residual_times_its_scale(pointwise):
    """A block output written once as int8 (builder/quantized_io.py) is the next block's residual: z_scale * z."""
    node = _qconv_node(1 if pointwise else 3, pads=(0, 0, 0, 0) if pointwise else (1, 1, 1, 1), act="Relu")
    k = node.attr("kernel_shape")
    x = _rand(2, 40, 5, 7, seed=11).to(memory_format=torch.channels_last)
    w = _weights(24, 40, *k, seed=12).to(memory_format=torch.channels_last)
    z = (torch.randn(2, 24, 5, 7, generator=_gen(13)) * 40).round().clamp(-128, 127).to(torch.int8).to(DEV)
    z = z.to(memory_format=torch.channels_last)
    sx, sw, sz, b = torch.tensor(0.031, device=DEV), _scales(24, seed=14), torch.tensor(0.02, device=DEV), None
    assert conv.supports(node, x, w, b, z, "int8") and not conv.supports(node, x, w, b, z)  # int8 z: quantized only
    kernel = conv.pointwise_as_gemm if pointwise else conv.conv2d
    y = kernel(node, x, w, b, z, config=SMALL, x_scale=sx, w_scale=sw, z_scale=sz)
    want = qconv(node, x, w, sx, sw, b, z, z_scale=sz)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, qconv(node, x, w, sx, sw, b, z.float()))  # the scale matters


def test_qconv_writes_an_8bit_output_and_an_8bit_copy_at_two_scales():
    """A block output whose residual the copy's scale would clip: 8-bit at its own scale, and the copy for the
    next convolution, both quantized from the float result (builder/quantized_io.py)."""
    node = _qconv_node(1, act="Relu")
    x = _rand(2, 40, 5, 7, seed=15).to(memory_format=torch.channels_last)
    w = _weights(24, 40, 1, 1, seed=16).to(memory_format=torch.channels_last)
    sx, sw, b = torch.tensor(0.031, device=DEV), _scales(24, seed=17), _rand(24, seed=18)
    sy, sq = torch.tensor(0.05, device=DEV), torch.tensor(0.01, device=DEV)  # the copy's narrower scale clips
    want = qconv(node, x, w, sx, sw, b, None, sy, sq)
    for kernel in (conv.conv2d, conv.pointwise_as_gemm):
        y, q = kernel(node, x, w, b, None, config=SMALL, x_scale=sx, w_scale=sw, y_scale=sy, q_scale=sq)
        assert y.dtype == q.dtype == torch.int8
        assert (y.int() - want[0].int()).abs().max() <= 1 and (q.int() - want[1].int()).abs().max() <= 1
    assert (want[1].int() == 127).any() and not (want[0].int() == 127).all()  # two different grids


def test_qconv_fp8_with_a_broadcast_residual():
    node = _qconv_node(3, pads=(1, 1, 1, 1), act="Relu", qtype="fp8")
    x, w, sx = _on_fp8_grid(1, 36, 5, 7, seed=6), _weights(12, 36, 3, 3, seed=7, qtype="fp8"), torch.tensor(0.0625)
    sw, z = _scales(12, seed=8), _rand(1, 12, 1, 7, seed=9)  # residual broadcast over rows: stride 0
    y = conv.conv2d(node, x, w, None, z, config=SMALL, x_scale=sx.to(DEV), w_scale=sw)
    torch.testing.assert_close(y, qconv(node, x, w, sx.to(DEV), sw, None, z), atol=1e-4, rtol=1e-4)


def test_supports_refuses_what_the_quantized_kernels_cannot_do():
    x, w8, b = torch.randn(1, 4, 5, 7), torch.zeros(6, 4, 3, 3, dtype=torch.int8), torch.randn(6)
    node = _qconv_node(3, pads=(1, 1, 1, 1))
    assert conv.supports(node, x, w8, b, None, "int8") and conv.supports(node, x.half(), w8.to(FP8), b, None, "fp8")
    assert not conv.supports(node, x, w8, b, None, "fp8")  # weights not of the layer's qtype
    assert not conv.supports(node, x, w8, b, None)  # int8 weights in a float layer
    assert not conv.supports(node, x.double(), w8, b, None, "int8")
    assert not conv.supports(_qconv_node(3, group=2), x, torch.zeros(6, 2, 3, 3, dtype=torch.int8), b, None, "int8")
    assert gemm.supports(torch.randn(3, 4), torch.zeros(4, 5, dtype=torch.int8), None, "", "int8")
    assert not gemm.supports(torch.randn(3, 4), torch.zeros(4, 5, dtype=torch.int8), None, "", "int4")
    sx = torch.tensor(0.1)
    assert gemm.scales_ok(sx, torch.ones(5), 5, sx.device) and gemm.scales_ok(sx, torch.ones(1), 5, sx.device)
    assert not gemm.scales_ok(sx, torch.ones(4), 5, sx.device)  # neither per tensor nor per channel
    assert not gemm.scales_ok(torch.ones(2), torch.ones(5), 5, sx.device)  # x quantized per tensor only
    assert not gemm.scales_ok(sx, torch.ones(5, dtype=torch.int32), 5, sx.device)


# --- the registered tactics ---------------------------------------------------------------
def _tactics(op, prefix):
    from kiln.tactics import _TACTICS, library, triton_gemm  # noqa: F401  (registers)

    return [t for t in _TACTICS[("kiln", op)] if t.name.startswith(prefix)]


def test_tactic_names_and_levels():
    for op, prefix, at_default_level in (("QGemm", "triton_qgemm_", 4), ("QConv", "triton_qconv_", 3),
                                         ("QConv", "triton_qconv1x1_", 4)):
        tactics = _tactics(op, prefix)
        assert sum(t.level == 3 for t in tactics) == at_default_level and all(3 <= t.level <= 5 for t in tactics), op
        assert len({t.name for t in tactics}) == len(tactics) >= 5


def _check_tactics(tactics, node, args, want):
    tried = 0
    for t in tactics:
        ok = t.applies(node, args)
        assert not ok or args[0].is_cuda, t.name  # CPU tensors are refused; the interpreter runs every config
        if ok or not args[0].is_cuda:
            torch.testing.assert_close(t.fn(node, *args), want, atol=1e-4, rtol=1e-4, msg=t.name)
            tried += 1
    assert tried >= 2


def test_every_qconv_tactic_handles_the_residual():
    node = _qconv_node(3, pads=(1, 1, 1, 1), act="Relu")
    x = _rand(1, 8, 3, 5, seed=10).to(memory_format=torch.channels_last)  # flat K: 72
    w, sx, sw = _weights(20, 8, 3, 3, seed=11), torch.tensor(0.02, device=DEV), _scales(20, seed=12)
    b, z = _rand(20, seed=13), _rand(1, 20, 3, 5, seed=14)
    args = [x, w, sx, sw, b, z]
    _check_tactics(_tactics("QConv", "triton_qconv_"), node, args, qconv(node, *args))


def test_every_qgemm_tactic_matches_the_layer_reference():
    node = _qgemm_node("Relu")
    x, w, sx, sw, b = _rand(2, 3, 40, seed=15), _weights(40, 24, seed=16), torch.tensor(0.02, device=DEV), \
        _scales(24, seed=17), _rand(24, seed=18)
    args = [x, w, sx, sw, b]
    _check_tactics(_tactics("QGemm", "triton_qgemm_"), node, args, qgemm(node, *args))


# --- 8-bit activations between layers (kiln/builder/quantized_io.py) ---------------------------
def test_gemm_reads_int8_activations_and_writes_the_next_layers_int8():
    node = _qgemm_node("Relu")
    node.attrs.update(x_quantized=1, float_type="float32")
    x = torch.randint(-128, 128, (37, 70), generator=_gen(1), dtype=torch.int8).to(DEV)
    w, sw, b = _weights(70, 45, seed=2), _scales(45, seed=3), _rand(45, seed=4)
    sx, sy = torch.tensor(0.05, device=DEV), torch.tensor(0.5, device=DEV)
    y = gemm.gemm(x, w, b, "Relu", config=SMALL, qtype="int8", x_scale=sx, w_scale=sw, y_scale=sy,
                  out_dtype=torch.float32)
    want = qgemm(node, x, w, sx, sw, b, sy)
    assert y.dtype == torch.int8
    assert (y.int() - want.int()).abs().max() <= 1  # one step at most, where x * (1/s) and x / s round apart


def test_conv_reads_int8_activations_and_writes_float():
    node = _qconv_node(3, pads=(1, 1, 1, 1), act="Relu")
    node.attrs.update(x_quantized=1, float_type="float32")
    x = torch.randint(-128, 128, (2, 5, 7, 6), generator=_gen(5), dtype=torch.int8).to(DEV)
    w, sw, b = _weights(9, 5, 3, 3, seed=6), _scales(9, seed=7), _rand(9, seed=8)
    sx = torch.tensor(0.05, device=DEV)
    y = conv.conv2d(node, x, w, b, None, config=SMALL, x_scale=sx, w_scale=sw, out_dtype=torch.float32)
    torch.testing.assert_close(y, qconv(node, x, w, sx, sw, b), rtol=1e-4, atol=1e-4)


# --- ResNet-50's convolutions at their real sizes, on the GPU ---------------------------------
RESNET_LAYERS = {
    # name: (C, OC, HW, kernel, stride, x arrives int8, writes int8, residual)
    "stem_7x7_s2": (3, 64, 56, 7, 2, False, False, False),
    "1x1_block_input": (256, 64, 56, 1, 1, False, True, False),
    "3x3_int8_in_out": (64, 64, 56, 3, 1, True, True, False),
    "3x3_s2_int8": (128, 128, 56, 3, 2, True, True, False),
    "1x1_expand_residual": (64, 256, 56, 1, 1, True, False, True),
    "1x1_s2_downsample": (256, 512, 56, 1, 2, False, False, False),
    "1x1_7x7_residual": (512, 2048, 7, 1, 1, True, False, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(RESNET_LAYERS))
def test_int8_conv_tactics_match_the_reference_on_resnet50_layers(layer):
    """Every level-3 INT8 convolution tactic on one of ResNet-50's layer kinds (batch 4, channels-last FP16),
    judged as the builder judges it: float outputs within FP16's share of the range, int8 outputs within one
    quantization step."""
    from kiln.builder.tactic_selection import _close

    C, OC, hw, k, s, x_int8, y_int8, residual = RESNET_LAYERS[layer]
    node = _qconv_node(k, strides=(s, s), pads=(k // 2,) * 4, act="Relu")
    node.precision = "int8"
    sx, sy = torch.tensor(0.037, device="cuda"), torch.tensor(0.021, device="cuda")
    x = _rand(4, C, hw, hw, seed=20, dtype=torch.float16).relu().to(memory_format=torch.channels_last)
    if x_int8:
        node.attrs.update(x_quantized=1, float_type="float16")
        x = quantize_int8(x, sx)
    w = _weights(OC, C, k, k, seed=21).to(memory_format=torch.channels_last)
    sw, b = _scales(OC, seed=22), _rand(OC, seed=23)
    oh = (hw + 2 * (k // 2) - k) // s + 1
    z = _rand(4, OC, oh, oh, seed=24, dtype=torch.float16).to(memory_format=torch.channels_last) if residual else None
    args = [x, w, sx, sw, b, z] + ([sy] if y_int8 else [])
    want = qconv(node, *args)
    for t in (t for t in _tactics("QConv", "triton_qconv_") if t.level <= 3):
        assert t.applies(node, args), t.name
        ok, why = _close(t.fn(node, *args), want, "int8")
        assert ok, f"{t.name}: {why}"
    fallbacks = [t for t in _tactics("QConv", "dequantized_") if t.applies(node, args)]
    assert len(fallbacks) == 2  # the float fallback, and cuDNN's fused ReLU (with or without the residual)
    for t in fallbacks:
        ok, why = _close(t.fn(node, *args), want, "int8")
        assert ok, f"{t.name}: {why}"
    pointwise = [t for t in _tactics("QConv", "triton_qconv1x1_") if t.level <= 3 and t.applies(node, args)]
    assert bool(pointwise) == (k == 1 and s == 1)  # 1x1 layers also run through the GEMM kernel
    for t in pointwise:
        ok, why = _close(t.fn(node, *args), want, "int8")
        assert ok, f"{t.name}: {why}"
    if not y_int8:  # a float output can also be written as an int8 copy for quantized readers
        args = args + [None, sy]
        want = qconv(node, *args)
        for t in [t for t in _tactics("QConv", "triton_qconv") if t.level <= 3 and t.applies(node, args)]:
            ok, why = _close(t.fn(node, *args), want, "int8")
            assert ok, f"{t.name} with a copy: {why}"


# --- 1x1 convolutions through the GEMM kernel -------------------------------------------------
@pytest.mark.parametrize("x_int8, y_int8, residual", [(False, False, True), (True, True, False), (True, False, True)])
def test_pointwise_qconv_as_a_gemm_matches_the_reference(x_int8, y_int8, residual):
    from kiln.builder.tactic_selection import _close

    node = _qconv_node(1, act="Relu")
    node.precision = "int8"
    sx, sy = torch.tensor(0.031, device=DEV), torch.tensor(0.07, device=DEV)
    x = _rand(2, 40, 3, 5, seed=30).to(memory_format=torch.channels_last)
    if x_int8:
        node.attrs.update(x_quantized=1, float_type="float32")
        x = quantize_int8(x, sx)
    w = _weights(24, 40, 1, 1, seed=31).to(memory_format=torch.channels_last)
    sw, b = _scales(24, seed=32), _rand(24, seed=33)
    z = _rand(2, 24, 3, 5, seed=34).to(memory_format=torch.channels_last) if residual else None
    assert conv.is_pointwise(node, x, w, z)
    args = [x, w, sx, sw, b, z] + ([sy] if y_int8 else [])
    y = conv.pointwise_as_gemm(node, *args[:2], b, z, config=SMALL, x_scale=sx, w_scale=sw,
                               y_scale=sy if y_int8 else None, out_dtype=torch.float32)
    want = qconv(node, *args)
    assert y.shape == want.shape and y.dtype == want.dtype and y.is_contiguous(memory_format=torch.channels_last)
    ok, why = _close(y, want, "int8")
    assert ok, why


def test_only_unpadded_stride_1_pointwise_layers_of_channels_last_data_go_through_the_gemm():
    x = torch.randn(1, 8, 4, 4).to(memory_format=torch.channels_last)
    w = torch.zeros(6, 8, 1, 1, dtype=torch.int8)
    assert conv.is_pointwise(_qconv_node(1), x, w, None)
    assert not conv.is_pointwise(_qconv_node(1), x.contiguous(), w, None)  # NCHW rows are not contiguous
    assert not conv.is_pointwise(_qconv_node(1, strides=(2, 2)), x, w, None)  # a downsampling 1x1
    assert not conv.is_pointwise(_qconv_node(1, pads=(1, 1, 1, 1)), x, w, None)
    assert not conv.is_pointwise(_qconv_node(3), x, torch.zeros(6, 8, 3, 3, dtype=torch.int8), None)
    z = torch.randn(1, 6, 1, 4).to(memory_format=torch.channels_last)  # broadcast residual: the conv kernel's
    assert not conv.is_pointwise(_qconv_node(1), x, w, z)


@pytest.mark.parametrize("pointwise", [False, True])
def test_a_conv_writes_an_int8_copy_of_its_float_output(pointwise):
    """A ResNet block's output is read as float (the residual) and as int8 (the next convolution): one kernel
    writes both, the copy quantized from the stored float values."""
    node = _qconv_node(1 if pointwise else 3, pads=(0,) * 4 if pointwise else (1,) * 4, act="Relu")
    x = _rand(2, 40, 3, 5, seed=40).to(memory_format=torch.channels_last)
    w = _weights(24, 40, *node.attr("kernel_shape"), seed=41).to(memory_format=torch.channels_last)
    sx, sw, b, sq = torch.tensor(0.031, device=DEV), _scales(24, seed=42), _rand(24, seed=43), torch.tensor(0.0625)
    run = conv.pointwise_as_gemm if pointwise else conv.conv2d
    y, q = run(node, x, w, b, None, config=SMALL, x_scale=sx, w_scale=sw, out_dtype=torch.float32,
               q_scale=sq.to(DEV))
    want_y, want_q = qconv(node, x, w, sx, sw, b, None, None, sq.to(DEV))
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    assert q.dtype == torch.int8 and q.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(q, quantize_int8(y, sq.to(DEV)))  # exactly what a reader quantizing y would get
