import pytest
import torch

from kiln.kernels import splitk_gemm

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if DEV == "cuda" else torch.float32  # the interpreter runs FP32 dots exactly
SMALL = splitk_gemm.SplitKConfig(3, 16, 16, 16, num_stages=1)


@pytest.mark.parametrize("M, K, N", [(1, 17, 70), (37, 100, 29), (20, 48, 16)])  # K not a multiple of the slices
def test_partial_products_sum_to_the_gemm(M, K, N):
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(DTYPE).to(DEV)
    w = torch.randn(K, N, generator=g).to(DTYPE).to(DEV)
    p = poisoned(lambda: splitk_gemm.partial_products(x, w, SMALL))  # a slice or tile left unwritten stays NaN
    assert p.shape == (3, M, N) and p.dtype == torch.float32
    tol = 2e-2 if DTYPE == torch.float16 else 1e-4
    torch.testing.assert_close(p.sum(0), splitk_gemm.reference(x, w), atol=tol, rtol=tol)


def test_transposed_weights_are_read_through_strides():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 40, generator=g).to(DTYPE).to(DEV)
    w = torch.randn(24, 40, generator=g).to(DTYPE).to(DEV).t()  # [K, N] view of an [N, K] tensor
    p = splitk_gemm.partial_products(x, w, SMALL)
    tol = 2e-2 if DTYPE == torch.float16 else 1e-4
    torch.testing.assert_close(p.sum(0), splitk_gemm.reference(x, w), atol=tol, rtol=tol)
