"""The 16-bit weight GEMV (kiln.kernels.bf16_gemv) and kiln.llm.quantize's DecodeWeight that routes a decode
step's F.linear to it: tiny shapes under TRITON_INTERPRET=1 without a GPU (FP16 weights: the interpreter
multiplies BF16 operands as raw integers), Llama-sized BF16 ones on the GPU."""

import os

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import bf16_gemv as bg
from kiln.kernels import fp8_gemv as fg

WDTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16


def operands(m, n, k, seed=0, xdtype=None):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, WDTYPE)
    x = torch.randn(m, k, generator=g).to(DEV, xdtype or WDTYPE)
    return x, w


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 64, 256, fg.GemvConfig(32, 64, 1, 4, 2)),  # whole tiles
    (4, 80, 200, fg.GemvConfig(32, 64, 1, 4, 2)),  # ragged N and K
    (8, 64, 512, fg.GemvConfig(16, 64, 3, 4, 2)),  # split-K (a short last split), reduced in the same launch
])
def test_matches_reference(m, n, k, cfg):
    x, w = operands(m, n, k)
    got = bg.bf16_gemv(x, w, cfg)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert rel_err(got, bg.reference(x, w)) < 1e-2


def test_fp32_activations_exact_and_rows_independent_of_the_batch():
    x, w = operands(5, 48, 256, seed=1, xdtype=torch.float32)
    cfg = fg.GemvConfig(16, 64, 2, 4, 2)
    full = bg.bf16_gemv(x, w, cfg)
    assert rel_err(full, x @ w.float().t()) < 1e-6
    assert torch.equal(bg.bf16_gemv(x[3:4], w, cfg)[0], full[3])


def test_refuses_other_weights():
    x, w = operands(1, 32, 64)
    with pytest.raises(ValueError, match="bfloat16 or float16 weight"):
        bg.bf16_gemv(x, w.float())


def test_decode_weight_is_the_plain_weight_where_the_gemv_does_not_run():
    from kiln.llm.quantize import DecodeWeight

    x, w = operands(3, 32, 64)
    dw = DecodeWeight(w, 0)  # no rows for the GEMV: torch's matmul
    assert torch.equal(F.linear(x, dw), F.linear(x, w)) and type(F.linear(x, dw)) is torch.Tensor
    assert dw.shape == w.shape and dw.data_ptr() == w.data_ptr()


def test_gemv_rows_is_zero_off_cuda():
    assert bg.gemv_rows(4096, 4096, torch.bfloat16, "cpu") == 0


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_llama_shapes_on_the_gpu(m, n, k):
    x, w = operands(m, n, k)
    assert rel_err(bg.bf16_gemv(x, w), bg.reference(x, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_decode_weight_runs_the_gemv_up_to_its_rows():
    from kiln.llm.quantize import DecodeWeight

    x, w = operands(8, 4096, 4096, seed=3)
    dw = DecodeWeight(w, 4)
    for m in (1, 4, 8):
        got = F.linear(x[:m], dw)
        want = bg.bf16_gemv(x[:m], w) if m <= 4 else F.linear(x[:m], w)
        assert torch.equal(got, want), m
    assert bg.gemv_rows(4096, 4096, torch.bfloat16, DEV, w) in bg.ROWS + (0,)


def _decoder_like(device, dtype):
    """What use_decode_gemv reads of a kiln.llm.model.DecoderModel: device, dtype, layers' matrices, lm_head."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(9)
    w = lambda n, k: (torch.randn(n, k, generator=g) * 0.02).to(device, dtype)
    return SimpleNamespace(device=torch.device(device), dtype=dtype, lm_head=w(8192, 1024),
                           layers=[{"qkv": w(3072, 1024), "o": w(1024, 1024), "input_norm": w(1, 1024)[0]}])


def test_use_decode_gemv_leaves_a_cpu_model_alone():
    from kiln.llm.quantize import use_decode_gemv

    model = _decoder_like("cpu", torch.float32)
    before = dict(model.layers[0])
    assert use_decode_gemv(model) == {} and all(model.layers[0][k] is v for k, v in before.items())


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_use_decode_gemv_wraps_where_the_gemv_won():
    from kiln.llm.quantize import DECODE_GEMV_MIN_BYTES, DecodeWeight, use_decode_gemv

    model = _decoder_like(DEV, torch.bfloat16)
    plain = {"qkv": model.layers[0]["qkv"], "o": model.layers[0]["o"], "lm_head": model.lm_head}
    chosen = use_decode_gemv(model)
    for key, w in plain.items():
        now = model.lm_head if key == "lm_head" else model.layers[0][key]
        big = w.numel() * w.element_size() >= DECODE_GEMV_MIN_BYTES
        chosen_key = key if key == "lm_head" else f"layers.0.{key}"  # use_decode_gemv's keys (linear_weights')
        assert isinstance(now, DecodeWeight) == (big and chosen.get(chosen_key, 0) > 0), key
        x = torch.randn(1, w.shape[1], device=DEV, dtype=torch.bfloat16)
        assert rel_err(F.linear(x, now), F.linear(x, w)) < 1e-2
    assert model.layers[0]["input_norm"].dim() == 1  # vectors are not matrices
