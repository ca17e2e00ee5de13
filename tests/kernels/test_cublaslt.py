"""kiln/kernels/cublaslt.py off the GPU: what it declines without touching CUDA (tests/gpu/test_cublaslt.py runs it)."""

import torch

from kiln.kernels import cublaslt


def test_the_fp8_gemm_is_declined_off_the_gpu_and_for_epilogues_or_types_cublaslt_lacks():
    cuda = torch.device("cuda")
    assert not cublaslt.supported(64, 64, 64, torch.float16, None, "", torch.device("cpu"))
    assert not cublaslt.supported(64, 64, 64, torch.float16, torch.float16, "Sigmoid", cuda)  # no such epilogue
    assert not cublaslt.supported(64, 64, 64, torch.float32, None, "", cuda)  # FP32 output: not offered
    assert not cublaslt.supported(64, 64, 64, torch.float16, torch.float32, "Relu", cuda)  # FP32 bias: likewise
