"""kiln/kernels/cublaslt.py off the GPU: what it declines without touching CUDA (tests/gpu/test_cublaslt.py runs it)."""

import pytest
import torch

from kiln.kernels import cublaslt


def test_the_fp8_gemm_is_declined_off_the_gpu_and_for_epilogues_or_types_cublaslt_lacks():
    cuda, Spec = torch.device("cuda"), cublaslt.Spec
    assert not cublaslt.supported(Spec(64, 64, 64, torch.float16, None), torch.device("cpu"))
    assert not cublaslt.supported(Spec(64, 64, 64, torch.float16, torch.float16, "Sigmoid"), cuda)  # no such epilogue
    assert not cublaslt.supported(Spec(64, 64, 64, torch.float32, None), cuda)  # FP32 output: not offered
    assert not cublaslt.supported(Spec(64, 64, 64, torch.float16, torch.float32, "Relu"), cuda)  # FP32 bias: likewise


def test_the_float_gemm_is_declined_for_mixed_types_and_fp8_for_row_major_weights():
    cuda, Spec, f16, bf16 = torch.device("cuda"), cublaslt.Spec, torch.float16, torch.bfloat16
    assert not cublaslt.supported(Spec(64, 64, 64, bf16, f16, "", f16), cuda)  # output of another type
    assert not cublaslt.supported(Spec(64, 64, 64, f16, bf16, "", f16), cuda)  # bias of another type
    assert not cublaslt.supported(Spec(64, 64, 64, f16, f16, "", torch.float32), cuda)  # FP32 inputs: not offered
    assert not cublaslt.supported(Spec(64, 64, 64, f16, f16, "", torch.float8_e4m3fn, False), cuda)  # FP8 takes TN
    assert not cublaslt.supported(Spec(64, 64, 64, f16, f16, "Relu", f16), torch.device("cpu"))


def test_a_gemms_spec_flattens_leading_axes():
    x, w = torch.zeros(2, 8, 32, dtype=torch.float8_e4m3fn), torch.zeros(32, 48, dtype=torch.float8_e4m3fn)
    spec = cublaslt.spec_of(x, w, True, "GeluErf", True, torch.bfloat16)
    assert spec == cublaslt.Spec(16, 48, 32, torch.float8_e4m3fn, torch.bfloat16, "GeluErf")
    assert cublaslt.spec_of(x, w, False, "", False, torch.float16).bias is None


def test_a_float_gemms_spec_records_its_inputs_type_and_weight_layout():
    x, w = torch.zeros(4, 32, dtype=torch.float16), torch.zeros(32, 48, dtype=torch.float16)
    row_major = cublaslt.spec_of(x, w, True, "Relu", False, torch.float16)
    assert row_major == cublaslt.Spec(4, 48, 32, torch.float16, torch.float16, "Relu", torch.float16, False)
    assert cublaslt.spec_of(x, w.t().contiguous().t(), True, "Relu", False, torch.float16).k_major
    fp8 = cublaslt.spec_of(x, w.to(torch.float8_e4m3fn), True, "", True, torch.float16)  # x quantized as it runs
    assert fp8.inputs == torch.float8_e4m3fn and fp8.k_major  # FP8 weights are made K-major to run


def test_scales_and_biases_are_converted_once_per_tensor():
    """A conversion or reciprocal is made on the first call and reused (no kernel per call); a tensor already
    in the asked type is used as it is."""
    scale, bias = torch.tensor([0.5]), torch.randn(8)
    assert cublaslt._constant(scale, torch.float32).data_ptr() == scale.data_ptr()  # no copy
    inverse = cublaslt._constant(scale, torch.float32, reciprocal=True)
    assert float(inverse) == 2.0 and cublaslt._constant(scale, torch.float32, reciprocal=True) is inverse
    half = cublaslt._constant(bias, torch.float16)
    assert half.dtype == torch.float16 and cublaslt._constant(bias, torch.float16) is half
    assert cublaslt._constant(bias.clone(), torch.float16) is not half  # another tensor, even with equal values


def test_the_hand_written_enum_values_are_nvmaths_and_both_bindings_are_named(monkeypatch):
    """The ctypes bindings write cuBLASLt's enum values by hand; nvmath-python (kiln[nvmath]) holds NVIDIA's."""
    monkeypatch.delenv("KILN_CUBLASLT_BINDINGS", raising=False)
    assert cublaslt.bindings("ctypes") is cublaslt.bindings("ctypes")
    with pytest.raises(cublaslt.CublasLtError, match="should be one of"):
        cublaslt.bindings("cffi")
    try:
        import nvmath.bindings.cublasLt  # noqa: F401
    except ImportError:
        assert cublaslt.bindings().name == "ctypes"  # without nvmath-python
        pytest.skip("nvmath-python is not installed here")
    assert cublaslt.bindings().name == "nvmath"  # the default where it imports
    values = cublaslt.bindings("nvmath").values()
    assert {name: getattr(cublaslt, name) for name in values} == values
