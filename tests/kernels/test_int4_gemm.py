"""The dequantizing INT4 GEMM against its torch reference (Triton's interpreter without a GPU: small shapes)."""

import pytest
import torch

from kiln.kernels import int4_gemm as k4

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = k4.Int4GemmConfig(16, 16, 16, num_warps=4, num_stages=1)  # K step of 32 values


def _operands(M, K, N, group, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group)
    x = torch.randn(M, K, generator=g)
    packed = torch.randint(0, 256, ((K + 1) // 2, N), generator=g, dtype=torch.uint8)
    scales = torch.rand(G, N, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8) if asym else None
    return [t.to(DEV) if t is not None else None for t in (x, packed, scales, zeros)]


@pytest.mark.parametrize("M, K, N, group, asym", [
    (5, 70, 29, 32, False),  # K not a multiple of the group or of the K step; last group partial
    (33, 45, 17, 16, True),  # odd K: the last byte holds one value
    (1, 64, 40, 64, True),
])
def test_matches_reference_on_odd_sizes_with_poisoned_output(M, K, N, group, asym):
    x, packed, scales, zeros = _operands(M, K, N, group, asym, seed=M)
    out = torch.full((M, N), float("nan"), device=DEV)
    y = k4.int4_gemm(x, packed, scales, zeros, group, config=SMALL, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    torch.testing.assert_close(y, k4.reference(x, packed, scales, zeros, group), atol=1e-4, rtol=1e-4)


def test_bias_input_scale_and_batched_strided_input():
    _, packed, scales, zeros = _operands(7, 38, 21, 8, True, seed=3)
    xb = torch.randn(2, 3, 76, device=DEV)[..., ::2]  # [2, 3, 38] with K stride 2
    bias, xs = torch.randn(21, device=DEV), torch.rand(38, device=DEV) + 0.5
    y = k4.int4_gemm(xb, packed, scales, zeros, 8, bias=bias, in_scale=xs, config=SMALL)
    assert y.shape == (2, 3, 21)
    torch.testing.assert_close(y, k4.reference(xb, packed, scales, zeros, 8, bias, xs), atol=1e-4, rtol=1e-4)


def test_fp16_input():
    x, packed, scales, _ = _operands(9, 40, 18, 32, False, seed=4)
    x = x.half()
    y = k4.int4_gemm(x, packed, scales.half(), None, 32, config=SMALL)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, k4.reference(x, packed, scales.half(), None, 32), atol=2e-2, rtol=2e-2)


def test_reference_unpacks_low_nibble_first():
    packed = torch.tensor([[0x21], [0x03]], dtype=torch.uint8)  # k=0:1, k=1:2, k=2:3
    assert k4.unpack(packed, 3).flatten().tolist() == [1, 2, 3]
    w = k4.dequantize(packed, torch.tensor([[2.0]]), None, 4, 3)
    assert w.flatten().tolist() == [-14.0, -12.0, -10.0]  # (u - 8) * 2


def test_bad_operands_are_refused():
    x, packed, scales, zeros = _operands(4, 32, 8, 16, True)
    with pytest.raises(ValueError, match="even"):
        k4.int4_gemm(x, packed, scales, zeros, 15)
    with pytest.raises(ValueError, match="scales"):
        k4.int4_gemm(x, packed, scales[:1], zeros, 16)
    with pytest.raises(ValueError, match="packed"):
        k4.int4_gemm(x[:, :30], packed, scales, zeros, 16)
