import os

import pytest
import torch
import triton
import triton.language as tl

from kiln.ir.graph import Node
from kiln.kernels import gemm
from kiln.ops.fused import fused_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TACTIC_TOL = 1e-2 if DEV == "cuda" else 1e-4  # tactic tests run FP32 as a "tf32" layer
SMALL = gemm.TileConfig(16, 16, 16, 4, 1, group_m=2)  # several tiles, a K remainder and a swizzle group edge
PARAMS = {"LeakyRelu": [0.2], "Clip": [-0.5, 0.7]}
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


@pytest.mark.parametrize("act", gemm.ACTIVATIONS)
def test_every_epilogue_matches_reference(act):
    x, w, b = _rand(37, 45, seed=1), _rand(45, 29, seed=2), _rand(29, seed=3)
    y = gemm.gemm(x, w, b, act, PARAMS.get(act, []), config=SMALL)
    torch.testing.assert_close(y, gemm.reference(x, w, b, act, PARAMS.get(act, [])), atol=1e-4, rtol=1e-4)


@triton.jit
def _erf_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, gemm.erf(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_epilogue_erf_is_accurate_in_fp32():
    """The GELU epilogue's erf (an approximation with fewer instructions than libdevice's) is within 1e-6 of
    torch.erf everywhere, tails and the sign included."""
    x = torch.cat([torch.linspace(-9, 9, 4001), torch.tensor([0.0, -0.0, 1e-6, -1e-6, 30.0, -30.0])]).to(DEV)
    y = torch.empty_like(x)
    _erf_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    torch.testing.assert_close(y, torch.erf(x.double()).float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("M, K, N", [(1, 17, 70), (70, 32, 17), (33, 64, 48)])  # K a multiple of BLOCK_K or not
def test_odd_sizes_without_bias(M, K, N):
    x, w = _rand(M, K, seed=M), _rand(K, N, seed=N)
    torch.testing.assert_close(gemm.gemm(x, w, None, "", config=SMALL), gemm.reference(x, w), atol=1e-4, rtol=1e-4)


def test_batched_input_and_strided_operands():
    x = _rand(2, 5, 90, seed=4)[..., ::2]  # [2, 5, 45], K stride 2: reshape copies, strides are honoured
    w = _rand(29, 45, seed=5).t()  # [45, 29] seen through a transposed view
    b = _rand(1, 29, seed=6)  # [1, N] bias, as some exporters keep it
    y = gemm.gemm(x, w, b, "Relu", config=SMALL)
    assert y.shape == (2, 5, 29)
    torch.testing.assert_close(y, gemm.reference(x, w, b, "Relu"), atol=1e-4, rtol=1e-4)


def test_fp16_inputs():
    x, w, b = (_rand(*s, seed=i, dtype=torch.float16) for i, s in enumerate([(37, 45), (45, 29), (29,)]))
    y = gemm.gemm(x, w, b, "GeluTanh", config=SMALL)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, gemm.reference(x, w, b, "GeluTanh"), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter multiplies bf16 operands as raw uint16")
def test_bf16_inputs():
    x, w, b = (_rand(*s, seed=i, dtype=torch.bfloat16) for i, s in enumerate([(37, 45), (45, 29), (29,)]))
    y = gemm.gemm(x, w, b, "Silu", config=SMALL)
    torch.testing.assert_close(y, gemm.reference(x, w, b, "Silu"), atol=5e-2, rtol=5e-2)


def test_every_output_element_is_written():
    x, w, b = _rand(37, 45, seed=7), _rand(45, 29, seed=8), _rand(29, seed=9)
    out = torch.full((37, 29), float("nan"), device=DEV)
    y = gemm.gemm(x, w, b, "", config=SMALL, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    torch.testing.assert_close(out, gemm.reference(x, w, b), atol=1e-4, rtol=1e-4)


def test_tf32_only_when_the_layer_asks():
    assert gemm.dot_precision(torch.float32, "float32") == "ieee"
    assert gemm.dot_precision(torch.float32, "tf32") == "tf32"
    assert gemm.dot_precision(torch.float32, "float16") == "ieee"  # an FP32 layer kept in an FP16 build
    assert gemm.dot_precision(torch.float16, "float16") == "tf32"  # Triton's default; moot for 16-bit operands


def test_supports_refuses_what_the_kernel_cannot_do():
    x, w, b = torch.randn(4, 8), torch.randn(8, 3), torch.randn(3)
    assert gemm.supports(x, w, b, "Relu") and gemm.supports(x, w, None, "")
    assert not gemm.supports(x, w, b, "Softplus")  # an activation the epilogue lacks
    assert not gemm.supports(x.double(), w.double(), b, "")
    assert not gemm.supports(x.half(), w, b, "")  # mixed operand dtypes
    assert not gemm.supports(x, torch.randn(7, 3), b, "")  # K mismatch
    assert not gemm.supports(x, w, torch.randn(4), "")  # bias of the wrong length
    assert not gemm.supports(torch.randn(8), w, b, "")  # 1-D x


# --- the registered tactics -------------------------------------------------------
def _gemm_tactics():
    from kiln.tactics import _TACTICS, triton_gemm  # noqa: F401  (registers)

    return [t for t in _TACTICS[("kiln", "FusedGemm")] if t.name.startswith("triton_gemm_")]


def test_tactic_names_and_levels():
    tactics = _gemm_tactics()
    assert 3 <= sum(t.level == 4 for t in tactics) <= 4 and all(4 <= t.level <= 5 for t in tactics)
    assert "triton_gemm_128x128x64_w4_s3" in {t.name for t in tactics}
    assert len({t.name for t in tactics}) == len(tactics)


def test_every_tactic_matches_the_layer_reference():
    node = Node("FusedGemm", ["x", "w", "b"], ["y"], {"activation": "GeluErf", "activation_params": []},
                domain="kiln", precision="tf32")
    x, w, b = _rand(2, 9, 45, seed=10), _rand(45, 70, seed=11), _rand(70, seed=12)
    want = fused_gemm(node, x, w, b)
    tried = 0
    for t in _gemm_tactics():
        ok = t.applies(node, [x, w, b])
        assert not ok or x.is_cuda, t.name  # CPU tensors are refused; the interpreter runs every config
        if ok or not x.is_cuda:
            torch.testing.assert_close(t.fn(node, x, w, b), want, atol=TACTIC_TOL, rtol=TACTIC_TOL, msg=t.name)
            tried += 1
    assert tried >= 3
    node.precision = "float32"  # exact FP32 is left to cuBLAS: not offered
    assert not any(t.applies(node, [x, w, b]) for t in _gemm_tactics())


def test_tactic_guards():
    from kiln.tactics import triton_gemm

    node = Node("FusedGemm", [], [], {}, domain="kiln")
    x32, x16 = torch.zeros(2), torch.zeros(2, dtype=torch.float16)
    assert triton_gemm._dtype_ok(node, x16) and not triton_gemm._dtype_ok(node, x32)
    node.precision = "tf32"
    assert triton_gemm._dtype_ok(node, x32) and not triton_gemm._dtype_ok(node, x32.double())
    assert triton_gemm._not_oversized(64, 1) and not triton_gemm._not_oversized(128, 1)  # M = 1: tiles up to 64
    assert triton_gemm._not_oversized(256, 70) and not triton_gemm._not_oversized(256, 30)
