import os

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import attention
from kiln.ops.fused import attention as layer_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TACTIC_TOL = 1e-2 if DEV == "cuda" else 1e-4  # tactic tests run FP32 as a "tf32" layer
SMALL = attention.FlashConfig(16, 16, 4, 1)  # several query tiles, several key blocks, a ragged last block
B, H, SQ, SK = 2, 2, 19, 37
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")  # interpreter's 0/0


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _qkv(d, k_transposed, dtype=torch.float32, sq=SQ, sk=SK, dv=None):
    q, k, v = _rand(B, H, sq, d, seed=1, dtype=dtype), _rand(B, H, sk, d, seed=2, dtype=dtype), \
        _rand(B, H, sk, dv or d, seed=3, dtype=dtype)
    return q, (k.transpose(-1, -2) if k_transposed else k), v


def _check(q, k, v, mask=None, scale=None, k_transposed=False, nan_guard=False, tol=1e-4):
    assert attention.supports(q, k, v, mask, k_transposed)
    got = attention.flash_attention(q, k, v, mask, scale, k_transposed, nan_guard, config=SMALL)
    want = attention.reference(q, k, v, mask, scale, k_transposed, nan_guard)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)
    return got


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128])
def test_head_dims(d):
    _check(*_qkv(d, k_transposed=d % 64 == 0), scale=0.3, k_transposed=d % 64 == 0)


@pytest.mark.parametrize("mask_shape", [(B, 1, 1, SK), (1, 1, SQ, SK), (SQ, SK), (B, H, SQ, SK)])
def test_broadcast_masks(mask_shape):
    q, k, v = _qkv(32, k_transposed=True)
    mask = _rand(*mask_shape, seed=4) * 3
    mask[..., -1, :3] = float("-inf")  # some masked keys
    _check(q, k, v, mask, k_transposed=True)


def test_keys_that_fill_whole_blocks():
    """Sk a multiple of BLOCK_N: the kernel drops its key-edge masking (EVEN_N)."""
    q, k, v = _qkv(32, k_transposed=True, sk=32)
    mask = _rand(B, 1, 1, 32, seed=4)
    mask[..., :5] = float("-inf")
    _check(q, k, v, mask, k_transposed=True)
    _check(q, k, v, k_transposed=True)


def test_queries_keys_and_head_dim_that_fill_whole_blocks():
    """Sq, Sk multiples of the tile and a power-of-two head dim: every mask is dropped (EVEN_M/N/D)."""
    q, k, v = _qkv(32, k_transposed=False, sq=32, sk=48)
    mask = _rand(B, 1, 1, 48, seed=4)
    out = torch.full((B, H, 32, 32), float("nan"), device=DEV)
    got = attention.flash_attention(q, k, v, mask, config=SMALL, out=out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(got, attention.reference(q, k, v, mask), atol=1e-4, rtol=1e-4)


# Triton 3.8's interpreter converts FP32 values in (124, 128) to FP8 as 64 (the carry into the exponent is
# lost); the GPU's cvt.rn.satfinite rounds them to 128.
@pytest.mark.parametrize("qtype", ["int8", pytest.param("fp8", marks=pytest.mark.skipif(
    INTERPRETED, reason="the interpreter rounds FP32 values just under 128 to FP8 64"))])
def test_an_8_bit_output_is_the_float_result_quantized(qtype):
    """With y_scale the kernel writes the quantized layer after it its 8-bit input (builder/quantized_io.py): the
    FP16 result quantized as the GEMMs' epilogues quantize (x * (1/s), saturating), from the float tile in
    registers."""
    from kiln.kernels.gemm import QTYPES
    from kiln.ops.fused import quantize_as

    q, k, v = _qkv(64, k_transposed=True, dtype=torch.float16)
    mask = _rand(B, 1, 1, SK, seed=4)
    y_scale = torch.tensor(0.004, device=DEV)  # a power of two's neighbour: x * (1/s) and x / s can differ
    got = attention.flash_attention(q, k, v, mask, k_transposed=True, config=SMALL, y_scale=y_scale, qtype=qtype)
    assert got.dtype == QTYPES[qtype] and got.shape == (B, H, SQ, 64)
    floats = attention.flash_attention(q, k, v, mask, k_transposed=True, config=SMALL)
    want = quantize_as(qtype, floats, y_scale)
    # one quantization step where the reciprocal's rounding moves a value across a rounding boundary
    torch.testing.assert_close(got.float() * y_scale, want.float() * y_scale, atol=y_scale.item() * 1.01,
                               rtol=0.07 if qtype == "fp8" else 0)


def test_causal_mask():
    q, k, v = _qkv(32, k_transposed=False, sk=SQ)
    causal = torch.full((SQ, SQ), float("-inf"), device=DEV).triu(1)
    _check(q, k, v, causal)


@pytest.mark.parametrize("nan_guard", [False, True])
def test_fully_masked_rows(nan_guard):
    q, k, v = _qkv(64, k_transposed=True)
    mask = torch.zeros(B, 1, SQ, SK, device=DEV)
    mask[0, :, 3] = float("-inf")  # every key masked for one query row of batch 0
    mask[1, :, :, 17:] = float("-inf")  # keys masked from the second block on (online softmax edge)
    out = _check(q, k, v, mask, k_transposed=True, nan_guard=nan_guard)
    row = out[0, :, 3]
    assert (row == 0).all() if nan_guard else row.isnan().all()
    assert out[:, :, :3].isfinite().all() and out[1].isfinite().all()


def test_three_dim_inputs_and_shared_kv_head():
    q = _rand(3, SQ, 32, seed=5)
    k, v = _rand(1, SK, 32, seed=6), _rand(1, SK, 32, seed=7)  # one k/v for all heads: read with stride 0
    _check(q, k, v, _rand(SQ, SK, seed=8))


def test_value_head_dim_differs():
    _check(*_qkv(32, k_transposed=False, dv=64))


def test_fp16_inputs():
    q, k, v = _qkv(64, k_transposed=True, dtype=torch.float16)
    mask = torch.zeros(1, 1, 1, SK, device=DEV, dtype=torch.float16)
    mask[..., -4:] = float("-inf")
    out = _check(q, k, v, mask, k_transposed=True, tol=2e-2)
    assert out.dtype == torch.float16


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter multiplies bf16 operands as raw uint16")
def test_bf16_inputs():
    _check(*_qkv(64, k_transposed=False, dtype=torch.bfloat16), tol=5e-2)


def test_every_output_element_is_written():
    q, k, v = _qkv(80, k_transposed=False)
    out = torch.full((B, H, SQ, 80), float("nan"), device=DEV)
    got = attention.flash_attention(q, k, v, None, None, config=SMALL, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    torch.testing.assert_close(got, attention.reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_heads_interleaved_like_q_after_a_qkv_projection():
    # q, k, v as BERT's split QKV gives them: [B, S, H*D] rows viewed as [B, H, S, D]
    qkv = _rand(B, SQ, 3 * H * 32, seed=9)
    q, k, v = (t.reshape(B, SQ, H, 32).transpose(1, 2) for t in qkv.split(H * 32, dim=-1))
    got = _check(q, k, v)
    merged = got.transpose(1, 2).reshape(B, SQ, H * 32)  # the head merge after attention
    assert merged.data_ptr() == got.data_ptr()  # a view: the output was written interleaved



def _window_operands(mask_images, dtype=torch.float32):
    """Swin's shifted windows: q, k^T, v [B, W, H, N, D] as views of one QKV projection (heads interleaved), N = 49
    (not a power of two), the mask [1 or B, W, H, N, N] a relative position bias plus a per-window mask."""
    b, w, n, d = 2, 3, 49, 32
    qkv = _rand(b * w, n, 3, H, d, seed=9, dtype=dtype)
    q, k, v = (t.reshape(b, w, n, H, d).transpose(2, 3) for t in qkv.unbind(2))
    bias = _rand(1, 1, H, n, n, seed=4)
    shift = torch.where(_rand(1, w, 1, n, n, seed=5) > 0.5, -100.0, 0.0)
    mask = (bias + shift).expand(mask_images, w, H, n, n).contiguous()
    if mask_images == 2:
        mask[1] += _rand(w, H, n, n, seed=6)  # each image its own mask: both of the mask's leading strides
    return q, k.transpose(-1, -2), v, mask.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c, _ in attention.CONFIGS], ids=lambda c: c.name)
def test_window_attention_on_every_flash_config(config):
    q, kt, v, mask = _window_operands(2, torch.float16)
    got = attention.flash_attention(q, kt, v, mask, 32 ** -0.5, True, config=config)
    want = attention.reference(q, kt, v, mask, 32 ** -0.5, True)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # p rounded to FP16 before p @ v


@pytest.mark.parametrize("mask_images", [1, 2])
def test_window_attention_five_dim_operands_and_mask(mask_images):
    """The kernel reads the mask's window as b % W of its merged batch index, the image as b // W."""
    b, w, n, d = 2, 3, 49, 32
    q, kt, v, mask = _window_operands(mask_images)
    k = kt.transpose(-1, -2)
    got = _check(q, kt, v, mask, scale=d ** -0.5, k_transposed=True)
    merged = got.transpose(2, 3).reshape(b * w, n, H * d)  # the head merge after attention: a view
    assert merged.data_ptr() == got.data_ptr()
    assert not attention.supports(q, k.expand(b, w, H, n, d)[:, :1].expand(b, w, H, n, d), v)  # no [B * W] view

@pytest.mark.parametrize("fp8_qk", [True, False])
def test_fp8_inputs_sharing_one_scale_are_read_as_codes(fp8_qk):
    """q, k, v as an FP8 engine's merged QKV projection writes them: E4M3 codes of one scale, heads interleaved.
    The kernel computes on the codes (q k^T in FP8, or converted to FP16) and applies the scale after the dots:
    the reference on the dequantized values, to FP16's rounding."""
    qkv = _rand(B, SQ, 3 * H * 64, seed=9) * 3
    scale = qkv.abs().max() / 448
    codes = (qkv / scale).to(attention.FP8)
    q, k, v = (t.reshape(B, SQ, H, 64).transpose(1, 2) for t in codes.split(H * 64, dim=-1))
    k = k.transpose(-1, -2)
    mask = _rand(B, 1, 1, SQ, seed=4)
    assert attention.supports(q, k, v, mask, True, fp8=True) and not attention.supports(q, k, v, mask, True)
    got = attention.flash_attention(q, k, v, mask, None, True, config=SMALL, qkv_scale=scale,
                                    float_type=torch.float16, fp8_qk=fp8_qk)
    assert got.dtype == torch.float16
    want = attention.reference(q, k, v, mask, None, True, qkv_scale=scale, float_type=torch.float16)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    layer = Node("Attention", ["q", "k", "v", "m", "", "s"], ["o"], {"k_transposed": 1, "float_type": "float16"},
                 domain="kiln")
    # the layer rounds its probabilities to FP16 before p @ v
    torch.testing.assert_close(layer_reference(layer, q, k, v, mask, None, scale), want, atol=5e-2, rtol=2e-2)


def test_supports_refuses_what_the_kernel_cannot_do():
    q, k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64)
    assert attention.supports(q, k, v) and attention.supports(q, k.transpose(-1, -2), v, None, True)
    assert not attention.supports(q, k, v, None, k_transposed=True)  # k is not [.., D, S]
    assert not attention.supports(q[..., :48], k[..., :48], v[..., :48])  # head dim 48
    assert not attention.supports(torch.randn(1, 2, 5, 256), torch.randn(1, 2, 7, 256), v)
    assert not attention.supports(q.half(), k, v)
    assert not attention.supports(q.double(), k.double(), v.double())
    assert not attention.supports(q, k, torch.randn(1, 2, 6, 64))  # Sk of k and v differ
    assert not attention.supports(q, k, v, torch.randn(1, 2, 5, 6))  # mask not broadcastable
    assert not attention.supports(q, k, v, torch.ones(5, 7, dtype=torch.bool))  # boolean masks: not additive
    assert not attention.supports(q[0, 0], k[0, 0], v[0, 0])  # 2-D


def _flash_tactics():
    from kiln.tactics import _TACTICS, triton_gemm  # noqa: F401  (registers)

    return [t for t in _TACTICS[("kiln", "Attention")] if t.name.startswith("triton_flash_")]


def test_every_tactic_matches_the_layer_reference():
    tactics = _flash_tactics()
    assert 2 <= sum(t.level == 4 for t in tactics) <= 4 and len({t.name for t in tactics}) == len(tactics)
    node = Node("Attention", ["q", "k", "v", "m"], ["o"], {"scale": 0.2, "k_transposed": 1, "nan_guard": 1},
                domain="kiln", precision="tf32")
    q, k, v = _qkv(64, k_transposed=True, sk=70)
    mask = torch.zeros(B, 1, 1, 70, device=DEV)
    mask[0, ..., :] = float("-inf")  # batch 0 fully masked: the guard's zeros
    want = layer_reference(node, q, k, v, mask)
    tried = 0
    for t in tactics:
        ok = t.applies(node, [q, k, v, mask])
        assert not ok or q.is_cuda, t.name  # CPU tensors are refused; the interpreter runs every config
        if ok or not q.is_cuda:
            torch.testing.assert_close(t.fn(node, q, k, v, mask), want, atol=TACTIC_TOL, rtol=TACTIC_TOL, msg=t.name)
            tried += 1
    assert tried >= 2
