"""Flash-attention forward: softmax(q @ k^T * scale + mask) @ v without the [S, S] matrix in memory.

One program per (BLOCK_M queries, batch*head). It walks the keys BLOCK_N at a time with
the online softmax (running row max m and row sum l, FP32 accumulator rescaled when
the max grows), in base 2 (exp2 with log2(e) folded into the scale).

Layouts through strides: q [B, H, Sq, D]; k [B, H, Sk, D] or already transposed
[B, H, D, Sk] (kiln::Attention's k_transposed); v [B, H, Sk, Dv]; leading dims
broadcast (an MQA/GQA-style k with H=1 gets stride 0). The additive mask may have
any shape broadcastable to [B, H, Sq, Sk]: broadcast dims are read with stride 0.
Five-dimensional operands [B, W, H, S, D] (Swin's windows: W windows an image, whose
mask [1, W, H, Sq, Sk] is the relative position bias plus the shifted windows' mask)
run as [B * W, H, S, D]: q, k, v and the output merge B and W as views, and the mask
keeps its own two strides, window (b % W) and image (b // W).
A row whose every key is masked (-inf) has l == 0: the result is 0 with nan_guard
(the exporter's Where(IsNaN) guard) and NaN (0/0) without, like the reference.
Head dims up to 128 (32, 64, 80, 96, 128 in the models that matter; D is padded to
a power of two inside the kernel and masked).

FP8 inputs (qkv_scale): q, k and v as FP8 E4M3 codes sharing one scale, as an FP8 engine's merged QKV
projection writes them (kiln/builder/quantized_io.py). q k^T runs on the codes on FP8 tensor cores (products
exact, FP32 sums); v is converted to the float type as it is loaded, since p is in that type. The scale is
applied after the dots: its square folded into the softmax scale, once more on the output. This is faster
than FP16 inputs, and than converting q and k too (fp8_qk=False; see docs/design/attention.md).

Reference: kiln.ops.fused.attention; `reference` below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm import QTYPES, quantize
from .pdl import launch_options, start_after_previous

HEAD_DIMS = (16, 32, 64, 80, 96, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)
_INT32_MAX = 2**31 - 1


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, ys_ptr, qs_ptr, H, SQ, SK, D, DV, qk_scale,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                      smb, smw, MW, smh, smm, smn, sob, soh, som, sod,
                      HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                      EVEN_D: tl.constexpr, NAN_GUARD: tl.constexpr, PREC: tl.constexpr, QUANT: tl.constexpr,
                      QKV_SCALED: tl.constexpr, CDT: tl.constexpr, QK_DT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      PDL: tl.constexpr):
    start_after_previous(PDL)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    # EVEN_*: the block divides that size, so its mask is a constant true that Triton drops
    m_ok = (tl.arange(0, BLOCK_M) < BLOCK_M) if EVEN_M else (rm < SQ)
    if EVEN_D:
        d_ok = rd < BLOCK_D
        dv_ok = rdv < BLOCK_DV
    else:
        d_ok = rd < D
        dv_ok = rdv < DV

    q = tl.load(q_ptr + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(QK_DT)
    if QKV_SCALED:  # FP8 codes: q k^T carries the scale twice, p v once (applied at the end)
        qs = tl.load(qs_ptr).to(tl.float32)
        qk_scale = qk_scale * qs * qs
    k_base = k_ptr + b * skb + h * skh + rd[:, None] * skd  # k^T tile [BLOCK_D, BLOCK_N]
    v_base = v_ptr + b * svb + h * svh + rdv[None, :] * svd  # v tile [BLOCK_N, BLOCK_DV]
    if HAS_MASK:
        mask_b = (b // MW) * smb + (b % MW) * smw  # MW windows an image (5-D operands), else MW = 1
        if MASK_ROW:  # one mask row for every query (BERT's padding mask): load it once per key block
            mask_base = m_ptr + mask_b + h * smh
        else:
            mask_base = m_ptr + mask_b + h * smh + rm[:, None] * smm

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for start_n in range(0, SK, BLOCK_N):
        cols = start_n + rn
        n_ok = (rn < BLOCK_N) if EVEN_N else (cols < SK)
        kt = tl.load(k_base + cols[None, :] * skn, mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(QK_DT)
        if HAS_MASK:  # log2 units, one FMA an element
            if MASK_ROW:  # one mask row for every query (BERT's padding mask), scaled once per column
                bias = (tl.load(mask_base + cols * smn, mask=n_ok, other=0.0).to(tl.float32) * _LOG2E_C)[None, :]
            else:
                bias = tl.load(mask_base + cols[None, :] * smn, mask=m_ok[:, None] & n_ok[None, :],
                               other=0.0).to(tl.float32) * _LOG2E_C
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale + bias
        else:
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        if not EVEN_N:  # keys past the end (none when the block divides Sk)
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all keys so far masked: nothing to subtract
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn, mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(CDT)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(CDT), v, acc, input_precision=PREC)
        m_i = m_new

    # one division a row, not one an element (FP8 codes: their scale folded in); a fully masked row (l == 0) gives
    # 0 * inf = NaN without nan_guard, like softmax over all -inf
    inv_l = (qs if QKV_SCALED else 1.0) / l_i
    out = acc * inv_l[:, None]
    if NAN_GUARD:
        out = tl.where((l_i > 0.0)[:, None], out, 0.0)
    if QUANT != "":  # 8-bit output for the quantized layer after (rounded to the float type first, as the reference)
        out = quantize(out.to(CDT), ys_ptr, QUANT)
    tl.store(o_ptr + b * sob + h * soh + rm[:, None] * som + rdv[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & dv_ok[None, :])


@dataclass(frozen=True)
class FlashConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"

    def smem_bytes(self, d: int, dv: int, itemsize: int) -> int:
        """Upper estimate (checked against sm_90 compiles): the q tile, num_stages + 1 k/v tiles, the p tile."""
        bd, bdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
        return (self.block_m * bd + (self.num_stages + 1) * self.block_n * (bd + bdv)
                + self.block_m * self.block_n) * itemsize


# (tile, lowest optimization level offering it): 128x32 for large batches, 64x64 for batch 1 (see
# docs/design/attention.md).
CONFIGS: list[tuple[FlashConfig, int]] = [
    (FlashConfig(128, 64, 8, 3), 3),
    (FlashConfig(64, 64, 4, 3), 3),
    (FlashConfig(128, 32, 4, 3), 3),
    (FlashConfig(64, 64, 4, 2), 4),
    (FlashConfig(64, 128, 4, 2), 4),
    (FlashConfig(128, 128, 8, 2), 4),
    (FlashConfig(64, 32, 4, 4), 4),
    (FlashConfig(32, 64, 4, 3), 5),
]


def _shapes(q, k, v, k_transposed: bool):
    """(lead dims, Sq, Sk, D, Dv) or None when the operands do not line up."""
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4, 5)):
        return None
    kd, ks = (k.shape[-2], k.shape[-1]) if k_transposed else (k.shape[-1], k.shape[-2])
    if kd != q.shape[-1] or ks != v.shape[-2]:
        return None
    try:
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        return None
    if tuple(lead) != tuple(q.shape[:-2]):
        return None
    return tuple(lead), q.shape[-2], ks, q.shape[-1], v.shape[-1]


def _merged(t: torch.Tensor) -> torch.Tensor | None:
    """A 5-D [B, W, H, S, D] operand as the view [B * W, H, S, D], or None where its strides do not allow one
    (broadcast over windows but not images, say); a 3-D or 4-D one as [B, H, S, D]."""
    if t.dim() < 5:
        return t if t.dim() == 4 else t.unsqueeze(0)
    if t.shape[0] != 1 and t.shape[1] != 1 and t.stride(0) != t.shape[1] * t.stride(1):
        return None
    return t.flatten(0, 1) if t.shape[1] != 1 or t.shape[0] == 1 else t.reshape(t.shape[0], *t.shape[2:])


def supports(q, k, v, mask=None, k_transposed: bool = False, fp8: bool = False) -> bool:
    """Same-dtype FP16/BF16/FP32 q, k, v (FP8 E4M3 ones with fp8) of rank 3 or 4, head dims in HEAD_DIMS, a
    broadcastable mask."""
    if q.dtype not in ((FP8,) if fp8 else DTYPES) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not (q.device == k.device == v.device) or min(q.numel(), k.numel(), v.numel()) == 0:
        return False
    geo = _shapes(q, k, v, k_transposed)
    if geo is None:
        return False
    lead, sq, sk, d, dv = geo
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        return False
    bh = math.prod(lead)
    if bh > 65535 or max(q.numel(), k.numel(), v.numel(), bh * sq * dv) > _INT32_MAX:
        return False
    if q.dim() == 5 and any(_merged(t.expand(*lead, *t.shape[-2:])) is None for t in (q, k, v)):
        return False
    if mask is not None:
        if mask.device != q.device or not mask.dtype.is_floating_point:
            return False
        try:
            if torch.broadcast_shapes(mask.shape, (*lead, sq, sk)) != torch.Size((*lead, sq, sk)):
                return False
        except RuntimeError:
            return False
        if bh * sq * sk > _INT32_MAX:  # the broadcast mask's offsets stay below 2**31
            return False
    return True


def _like_q(q: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output (of q's dtype unless given) whose heads are interleaved within each position when q's are
    ([.., S, H, D] in memory, as after a fused QKV projection): the head merge after attention (transpose,
    reshape) is then a view, not a copy per layer. Otherwise contiguous."""
    dtype = dtype or q.dtype
    if q.dim() >= 4 and q.stride(-3) < q.stride(-2):
        *lead, h, s, dv = shape
        return torch.empty((*lead, s, h, dv), dtype=dtype, device=q.device).transpose(-2, -3)
    return torch.empty(shape, dtype=dtype, device=q.device)


def flash_attention(q, k, v, mask=None, scale: float | None = None, k_transposed: bool = False,
                    nan_guard: bool = False, precision: str = "float32", config: FlashConfig = CONFIGS[0][0],
                    out: torch.Tensor | None = None, y_scale: torch.Tensor | None = None,
                    qtype: str = "", qkv_scale: torch.Tensor | None = None,
                    float_type: torch.dtype = torch.float16, fp8_qk: bool = True) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v; returns a [.., Sq, Dv] tensor of q's dtype, laid out like q, or
    with y_scale its qtype's 8-bit values. qkv_scale: q, k and v are FP8 codes of that one scale, computed in
    float_type (also the output's type); fp8_qk=False converts q and k to it as well (slower, kept to compare)."""
    lead, sq, sk, d, dv = _shapes(q, k, v, k_transposed)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cdt = float_type if qkv_scale is not None else q.dtype
    o = out if out is not None else _like_q(q, (*lead, sq, dv), QTYPES[qtype] if y_scale is not None else cdt)
    q4, o4 = _merged(q), _merged(o)
    k4, v4 = (_merged(t.expand(*lead, *t.shape[-2:])) for t in (k, v))
    B, H = q4.shape[0], q4.shape[1]
    skb, skh = k4.stride(0), k4.stride(1)
    skn, skd = (k4.stride(3), k4.stride(2)) if k_transposed else (k4.stride(2), k4.stride(3))
    windows, smw = 1, 0  # 5-D: the mask's window index is b % W of the merged batch index b
    if mask is not None:
        m4 = mask.expand(*lead, sq, sk)
        if m4.dim() == 5:
            windows, smw = m4.shape[1], m4.stride(1)
            ms = (m4.stride(0), *m4.stride()[2:])
        else:
            m4 = m4 if m4.dim() == 4 else m4.unsqueeze(0)
            ms = m4.stride()
    else:
        m4, ms = q4, (0, 0, 0, 0)
    from .gemm import dot_precision

    grid = (triton.cdiv(sq, config.block_m), B * H)
    pdl = launch_options(q.device)
    _flash_fwd_kernel[grid](
        q4, k4, v4, m4, o4, y_scale if y_scale is not None else q4, qkv_scale if qkv_scale is not None else q4,
        H, sq, sk, d, dv, scale * _LOG2E,
        *q4.stride(), skb, skh, skn, skd, *v4.stride(), ms[0], smw, windows, *ms[1:], *o4.stride(),
        HAS_MASK=mask is not None, MASK_ROW=mask is not None and ms[2] == 0, EVEN_N=sk % config.block_n == 0,
        EVEN_M=sq % config.block_m == 0,
        EVEN_D=d == max(16, triton.next_power_of_2(d)) and dv == max(16, triton.next_power_of_2(dv)),
        NAN_GUARD=bool(nan_guard), PREC=dot_precision(cdt, precision), QUANT=qtype if y_scale is not None else "",
        QKV_SCALED=qkv_scale is not None, CDT=_TL[cdt],
        QK_DT=tl.float8e4nv if qkv_scale is not None and fp8_qk else _TL[cdt],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), PDL=bool(pdl), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl)
    return o


def reference(q, k, v, mask=None, scale=None, k_transposed=False, nan_guard=False, qkv_scale=None,
              float_type=torch.float16):
    """kiln.ops.fused.attention's semantics in FP32, returned in q's dtype (float_type for FP8 codes of
    qkv_scale)."""
    if qkv_scale is not None:
        q, k, v = ((t.float() * qkv_scale.float()).to(float_type) for t in (q, k, v))
    if k_transposed:
        k = k.transpose(-1, -2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1)
    if nan_guard:
        probs = torch.nan_to_num(probs, nan=0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)
