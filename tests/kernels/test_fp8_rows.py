"""Per-row FP8 quantization of activations (kiln.kernels.fp8_rows) against its torch reference: tiny shapes
under TRITON_INTERPRET=1 without a GPU, a decode-sized batch on the GPU."""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import fp8_rows

FP8 = torch.float8_e4m3fn


def exact_rows(m, k, seed=0):
    """Rows whose quotients x / scale are FP8 values already (each row's largest |x| is 448 times a power of two),
    so any correct rounding gives the same codes: Triton's interpreter rounds FP32 to FP8 loosely."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=g) * 60).clamp(-448, 448).to(FP8).float()
    codes[:, 0] = 448.0
    return codes * 2.0 ** torch.randint(-6, 4, (m, 1), generator=g).float()


@pytest.mark.parametrize("m,k", [(3, 200), (2, 5000)])  # one K block; several, with a ragged last one
def test_codes_and_scales_equal_the_reference(m, k):
    x = exact_rows(m, k).to(DEV)
    x[1] = 0.0  # an all-zero row: scale 1e-12, codes 0
    got_q, got_s = fp8_rows.quantize_rows(x)
    want_q, want_s = fp8_rows.reference(x)
    assert got_q.dtype == FP8 and got_s.shape == (m, 1)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_strided_rows_and_bad_input():
    x = exact_rows(4, 96, seed=1).to(DEV)
    wide = torch.zeros(4, 128, device=DEV)
    wide[:, :96] = x
    q, _ = fp8_rows.quantize_rows(wide[:, :96])
    assert torch.equal(q.view(torch.uint8), fp8_rows.reference(x)[0].view(torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        fp8_rows.quantize_rows(torch.zeros(2, 3, 4, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_bf16_decode_batch_on_the_gpu():
    x = torch.randn(64, 14336, device=DEV, dtype=torch.bfloat16) * 3
    q, s = fp8_rows.quantize_rows(x)
    want_q, want_s = fp8_rows.reference(x)
    assert torch.equal(s, want_s)
    assert (q.float() - want_q.float()).abs().max().item() == 0


def test_launch_passes_only_the_kernels_parameters(monkeypatch):
    """(The interpreter ignores a keyword the kernel does not take; the GPU launcher refuses it.)"""
    import inspect

    kernel = fp8_rows._quantize_rows_kernel

    class Checked:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = list(inspect.signature(kernel.fn).parameters)
                given = set(names[:len(args)]) | {k for k in kwargs if k not in ("num_warps", "num_stages")}
                assert given == set(names), sorted(given ^ set(names))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(fp8_rows, "_quantize_rows_kernel", Checked())
    fp8_rows.quantize_rows(exact_rows(2, 64).to(DEV))
