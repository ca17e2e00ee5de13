"""Fused residual add + LayerNorm over the last axis (one read of each input, one write);
without the add, plain LayerNorm (BERT's embedding LayerNorm, faster than torch's kernel) or RMSNorm
(Llama's: one pass where the reference casts, normalizes and scales).

Rows are read through two leading strides, so a transposed view (ViT's sequence-first
attention output, say) is read where it lies instead of being copied first; outputs are
contiguous. With a scale and a qtype it also writes the normalized rows as int8 / FP8 values,
the input of the quantized GEMMs after it (BERT's QKV and FFN1), so they need no quantize pass.
With `parts`, the first input is a split-K GEMM's FP32 partial products [S, rows, n]
(kernels/splitk_gemm.py) plus a bias: the GEMM's reduction happens here, in the same pass.

Reference: torch.nn.functional.layer_norm(a + b, ...), second output a + b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm import QTYPES, quantize
from .pdl import launch_options, start_after_previous


@dataclass(frozen=True)
class Launch:
    """How the rows are spread: `rows` per program, `per_warp` elements of the (power-of-two) row block a warp.
    With `fill`, a program takes as many rows as fill `fill` elements of row blocks (at least `rows`): narrow
    rows (ConvNeXt's and MobileViT's 40-160 channels, Swin's 96) would otherwise give one short row a program,
    a hundred thousand programs at batch 32 that each wait on one small load."""
    rows: int = 1
    per_warp: int = 256
    fill: int = 0

    @property
    def name(self) -> str:
        return f"f{self.fill}_e{self.per_warp}" if self.fill else f"r{self.rows}_e{self.per_warp}"

    def rows_for(self, block: int) -> int:
        return max(self.rows, self.fill // block) if self.fill else self.rows

    def warps(self, block: int) -> int:
        return min(16, max(1, block * self.rows_for(block) // self.per_warp))

    def offered(self, n_cols: int) -> bool:
        """A filling launch only for rows narrow enough that it packs many a program (8 or more): wide rows
        have the fixed launches."""
        return not self.fill or self.rows_for(triton.next_power_of_2(n_cols)) >= 8


# The first is the default; which is fastest depends on the row count and width and on an FP8 copy (see
# docs/design/small-kernels.md). The tactics offer each (tactics/triton_tactics.py): the builder times them.
LAUNCHES = (Launch(1, 256), Launch(1, 512), Launch(1, 1024), Launch(2, 1024), Launch(1, 256, fill=2048),
            Launch(1, 512, fill=4096))


@triton.jit
def _skip_layernorm_kernel(a_ptr, b_ptr, c_ptr, g_ptr, beta_ptr, y_ptr, s_ptr, qs_ptr, q_ptr, bias_ptr, n_cols, eps,
                           rows1, n_rows, sa0, sa1, sb0, sb1, sc0, sc1, HAS_SKIP: tl.constexpr, HAS_SKIP2: tl.constexpr,
                           HAS_BETA: tl.constexpr, WRITE_SUM: tl.constexpr, QUANT: tl.constexpr, RMS: tl.constexpr,
                           PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                           PDL: tl.constexpr):
    start_after_previous(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]: ROWS rows per program
    r0, r1 = row // rows1, row % rows1
    cols = tl.arange(0, BLOCK)[None, :]
    col_ok = cols < n_cols
    mask = col_ok & (row < n_rows)
    off = row * n_cols + cols
    if PARTS > 0:  # a split-K GEMM's FP32 partial products, contiguous [PARTS, n_rows, n_cols]
        s = tl.load(a_ptr + off, mask=mask, other=0.0)
        for i in tl.static_range(1, PARTS):
            s += tl.load(a_ptr + i * n_rows * n_cols + off, mask=mask, other=0.0)
    else:
        s = tl.load(a_ptr + r0 * sa0 + r1 * sa1 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_SKIP:
        s += tl.load(b_ptr + r0 * sb0 + r1 * sb1 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SKIP2:  # a third addend (BERT's embeddings: word + token type + position), read through its strides
        s += tl.load(c_ptr + r0 * sc0 + r1 * sc1 + cols, mask=mask, other=0.0).to(tl.float32)
    if WRITE_SUM:
        tl.store(s_ptr + off, s.to(s_ptr.dtype.element_ty), mask=mask)
    if RMS:  # RMSNorm: no centring
        d = s
    else:
        d = tl.where(mask, s - (tl.sum(s, axis=1) / n_cols)[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / n_cols + eps)
    y = d * rstd[:, None] * tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BETA:
        y += tl.load(beta_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + off, y, mask=mask)
    if QUANT != "":  # quantized from the stored (rounded) values, as a reader quantizing y itself would
        tl.store(q_ptr + off, quantize(y, qs_ptr, QUANT).to(q_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor):
    """t as a 3-D view [R0, R1, n] with unit stride along n (no copy), or None."""
    if t.dim() == 0 or t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    shape = [1] * max(0, 3 - t.dim()) + list(t.shape)
    try:
        return t.view(shape) if t.dim() <= 3 else t.view(-1, *t.shape[-2:])
    except RuntimeError:  # leading axes that no view can merge
        return None


def supports(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor) -> bool:
    """Same-shape inputs with rows of unit stride, a row that fits one block (BERT/ViT/Llama hidden sizes do)."""
    return (a.shape == b.shape and a.dtype == b.dtype and _rows(a) is not None and _rows(b) is not None
            and gamma.numel() == a.shape[-1] and a.shape[-1] <= 16384 and a.numel() > 0)


def skip_layernorm(a, b, gamma, beta=None, eps: float = 1e-5, write_sum: bool = True,
                   q_scale: torch.Tensor | None = None, qtype: str = "", rms: bool = False,
                   y_dtype: torch.dtype | None = None, launch: Launch = LAUNCHES[0], c=None):
    """(LayerNorm(a + b), a + b or None[, the normalized rows quantized with q_scale as qtype]).
    b=None: LayerNorm(a). c: a third addend, a + b + c (shaped like a; a broadcast view reads where it lies).
    rms: RMSNorm instead of LayerNorm. y_dtype: the normalized rows' type (default a's; FP32 for a model's FP32
    output)."""
    return _launch(a, _rows(a), b, gamma, beta, eps, write_sum, q_scale, qtype, rms, y_dtype=y_dtype, launch=launch,
                   c=c)


def partials_layernorm(parts: torch.Tensor, bias, b, gamma, beta=None, eps: float = 1e-5, write_sum: bool = True,
                       y_dtype: torch.dtype | None = None):
    """(LayerNorm(parts.sum(0) + bias + b), that sum or None), shaped and typed like b (the norm in y_dtype if
    given): parts are a split-K GEMM's FP32 partial products [S, rows, n] (bias may be None)."""
    return _launch(b, _rows(b), b, gamma, beta, eps, write_sum, None, "", False, parts=parts, bias=bias,
                   y_dtype=y_dtype)


def _launch(like, a3, b, gamma, beta, eps, write_sum, q_scale, qtype, rms, parts=None, bias=None, y_dtype=None,
            launch: Launch = LAUNCHES[0], c=None):
    """The kernel over the rows of `like` (its shape and dtype are the outputs'); a3: the first input as a
    3-D row view, or the skip's when the first input is `parts`."""
    n = like.shape[-1]
    rows = like.numel() // n
    b3 = _rows(b) if b is not None else a3
    c3 = _rows(c) if c is not None else a3
    y = torch.empty(like.shape, dtype=y_dtype or like.dtype, device=like.device)
    s = torch.empty(like.shape, dtype=like.dtype, device=like.device) if write_sum else y
    q = torch.empty(like.shape, dtype=QTYPES[qtype], device=like.device) if q_scale is not None else y
    block = triton.next_power_of_2(n)
    pdl = launch_options(like.device)
    per_program = launch.rows_for(block)
    _skip_layernorm_kernel[(triton.cdiv(rows, per_program),)](
        parts if parts is not None else like, b if b is not None else like, c if c is not None else like, gamma,
        beta if beta is not None else gamma, y, s, q_scale if q_scale is not None else gamma, q,
        bias if bias is not None else gamma, n, eps, a3.shape[1], rows, a3.stride(0), a3.stride(1),
        b3.stride(0), b3.stride(1), c3.stride(0), c3.stride(1), HAS_SKIP=b is not None, HAS_SKIP2=c is not None,
        HAS_BETA=beta is not None, WRITE_SUM=write_sum,
        QUANT=qtype if q_scale is not None else "", RMS=rms, PARTS=parts.shape[0] if parts is not None else 0,
        HAS_BIAS=bias is not None, BLOCK=block, ROWS=per_program, PDL=bool(pdl), num_warps=launch.warps(block), **pdl)
    return (y, s if write_sum else None) + ((q,) if q_scale is not None else ())


def layernorm(x, gamma, beta=None, eps: float = 1e-5, launch: Launch = LAUNCHES[0]):
    return skip_layernorm(x, None, gamma, beta, eps, write_sum=False, launch=launch)[0]


def rms_norm(x, gamma, eps: float = 1e-6):
    return skip_layernorm(x, None, gamma, None, eps, write_sum=False, rms=True)[0]


def reference(a, b, gamma, beta=None, eps: float = 1e-5):
    s = a + b
    return torch.nn.functional.layer_norm(s.float(), s.shape[-1:], gamma.float(),
                                          beta.float() if beta is not None else None, eps).to(a.dtype), s
