"""GEMV over 16-bit float weights for a decode step's few rows, and the rule that says when it beats cuBLAS.

`bf16_gemv(x, w)`: x [M <= 64, K] @ w [N, K].T in x's dtype, through kernels/fp8_gemv.py's weight-only kernel
without a scale: the weight read once in its own type straight into the tensor cores (BF16 or FP16, FP32
accumulation), split-K reduced in the same launch, launched as a programmatic dependent on Hopper.

`gemv_rows(n, k, dtype, device)`: the most rows (of 1, 2, 4, 8) up to which the kernel was faster than
torch.matmul (cuBLAS) for an [n, k] weight on this device, timed once per shape and type on weights larger than
L2 (0: cuBLAS was faster at one row already, or the device is not CUDA, or a graph is being captured and the
shape was never timed). kiln.llm.quantize's DecodeWeight follows it.
"""

from __future__ import annotations

import torch

from . import fp8_gemv as fg

DTYPES = (torch.bfloat16, torch.float16)
ROWS = (1, 2, 4, 8)  # batch sizes the rule is timed at (a decode step's; above them cuBLAS's GEMMs take over)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, config: fg.GemvConfig | None = None,
              out: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M <= 64, K] @ w [N, K].T (w BF16 or FP16) -> [M, N] in x's dtype."""
    if w.dtype not in DTYPES:
        raise ValueError(f"bf16_gemv takes a bfloat16 or float16 weight, got {w.dtype}")
    return fg.fp8_gemv(x, w, None, config, out, pdl)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product in torch (FP32), in x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


_RULES: dict = {}


def gemv_rows(n: int, k: int, dtype: torch.dtype, device, weight: torch.Tensor | None = None) -> int:
    """Rows up to which bf16_gemv beat torch.matmul for an [n, k] `dtype` weight on `device` (see above)."""
    device = torch.device(device)
    key = (n, k, dtype, str(device))
    if key in _RULES:
        return _RULES[key]
    if device.type != "cuda" or dtype not in DTYPES or torch.cuda.is_current_stream_capturing():
        return 0
    weights = fg.timing_weights(n, k, dtype, device, weight)
    rows = 0
    for m in ROWS:
        cfg = fg.choose_config(n, k, dtype, device, dtype, weight, single_row=m == 1)
        x = torch.zeros((m, k), dtype=dtype, device=device)
        ours = fg.time_us(lambda w, x=x, cfg=cfg: bf16_gemv(x, w, cfg), weights)
        theirs = fg.time_us(lambda w, x=x: torch.matmul(x, w.t()), weights)
        if ours >= theirs:
            break
        rows = m
    _RULES[key] = rows
    return rows
