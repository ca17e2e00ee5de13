"""kernels/rescale.py (an 8-bit GEMM's epilogue, or an activation's quantization, in one pass) against
its reference; Triton's interpreter without a GPU."""

import pytest
import torch

from kiln.kernels import rescale

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("act, channel_scales", [("GeluErf", True), ("Relu", False), ("", True)])
def test_int32_sums_scaled_biased_and_activated(act, channel_scales):
    acc = torch.randint(-20000, 20000, (37, 45), generator=_gen(0), dtype=torch.int32).to(DEV)  # odd sizes
    sx = torch.tensor(0.023, device=DEV)
    sw = (torch.rand(45 if channel_scales else 1, generator=_gen(1)) * 1e-3).to(DEV)
    b = torch.randn(45, generator=_gen(2)).to(DEV)
    got = rescale.rescale(acc, sx, sw, b, act, out_dtype=torch.float16)
    want = rescale.reference(acc, sx, sw, b, act, out_dtype=torch.float16)
    assert got.dtype == torch.float16 and got.shape == acc.shape
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_quantizing_an_activation_to_int8_rounds_half_to_even_and_saturates():
    s = torch.tensor(0.0625, device=DEV)  # a power of two: x / s exact, ties stay ties
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -128.5, 127.5, 300.0, -300.0])
    x = (torch.cat([ties, torch.randn(1013, generator=_gen(3)) * 60]) * 0.0625).reshape(3, 341).half().to(DEV)
    got = rescale.rescale(x, y_scale=s, qtype="int8")
    assert got.dtype == torch.int8
    assert got.view(-1)[:10].tolist() == [0, 2, 2, 0, -2, 126, -128, 127, 127, -128]
    assert torch.equal(got, rescale.reference(x, y_scale=s, qtype="int8"))


def test_an_fp8_epilogue_with_requantization():
    s = torch.tensor(0.0625, device=DEV)
    x = (torch.randn(5, 2051, generator=_gen(4)) * 40).to(FP8).float() * 0.0625  # on the E4M3 grid
    x.view(-1)[:2] = torch.tensor([1000.0, -1000.0])  # saturates to +-448
    got = rescale.rescale(x.to(DEV), act="Relu", y_scale=s, qtype="fp8")
    assert got.dtype == FP8 and got.float().view(-1)[:2].tolist() == [448.0, 0.0]
    assert torch.equal(got.float(), rescale.reference(x.to(DEV), act="Relu", y_scale=s, qtype="fp8").float())


def test_refuses_what_it_cannot_do():
    with pytest.raises(ValueError):
        rescale.rescale(torch.zeros(2, 2), x_scale=torch.tensor(1.0))  # a scale without its partner
    with pytest.raises(ValueError):
        rescale.rescale(torch.zeros(2, 2), y_scale=torch.tensor(1.0), qtype="int4")


@pytest.mark.parametrize("zero_point", [-128, -5, 0, 127])
@pytest.mark.parametrize("dtype, channels_last", [(torch.float32, False), (torch.float16, True)])
def test_quantize_linear_is_onnxs_with_a_zero_point(zero_point, dtype, channels_last):
    from kiln.ir.graph import Node
    from kiln.ops.quant import quantize_linear
    from kiln.tactics import candidates, triton_tactics  # noqa: F401  (registers)

    x = torch.randn(2, 5, 3, 7, generator=_gen(zero_point + 200)) * 8
    x[0, 0, 0, :5] = torch.tensor([0.025, 0.075, -0.125, 1e4, -1e4])  # exact halves of the scale; saturation
    x = x.to(dtype).to(DEV)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    s, z = torch.tensor(0.05, device=DEV), torch.tensor(zero_point, dtype=torch.int8, device=DEV)
    node = Node("QuantizeLinear", ["x", "s", "z"], ["y"], {})
    want = quantize_linear(node, x, s, z)
    got = rescale.quantize_linear(x, s, z)
    assert got.dtype == torch.int8 and got.stride() == x.stride() and torch.equal(got, want)
    (t,) = [t for t in candidates(node) if t.name == "triton_quantize_linear"]
    assert t.applies(node, [x, s, z]) == x.is_cuda
    assert not t.applies(node, [x, s, z.to(torch.uint8)]) and not t.applies(node, [x, torch.ones(5), z])


@pytest.mark.parametrize("zero_point", [-128, 9])
def test_dequantize_linear_is_onnxs_with_a_zero_point(zero_point):
    from kiln.ir.graph import Node
    from kiln.ops.quant import dequantize_linear
    from kiln.tactics import candidates, triton_tactics  # noqa: F401  (registers)

    q = torch.randint(-128, 128, (2, 6, 5, 3), generator=_gen(zero_point + 300), dtype=torch.int8).to(DEV)
    q = q.to(memory_format=torch.channels_last)
    s, z = torch.tensor(0.037, device=DEV), torch.tensor(zero_point, dtype=torch.int8, device=DEV)
    node = Node("DequantizeLinear", ["q", "s", "z"], ["y"], {})
    want = dequantize_linear(node, q, s, z)
    got = rescale.dequantize_linear(q, s, z)
    assert got.dtype == want.dtype == torch.float32 and got.stride() == q.stride() and torch.equal(got, want)
    (t,) = [t for t in candidates(node) if t.name == "triton_dequantize_linear"]
    assert t.applies(node, [q, s, z]) == q.is_cuda
    assert not t.applies(node, [q.to(torch.uint8), s, z]) and not t.applies(node, [q, s.half(), z])
