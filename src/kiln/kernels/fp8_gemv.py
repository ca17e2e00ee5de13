"""Weight-only 8-bit matrix multiply for the few rows of a decode step: y = x @ (codes * scale[:, None]).T.

x [M, K] BF16/FP16/FP32 activations (M small: one row per decoding sequence), codes [N, K] FP8 E4M3 (or INT8,
or 16-bit for comparison with a plain GEMV) weights (row-major, as `torch.nn.functional.linear` holds a weight), scale [N] FP32 per output channel. The weight is
read once, one byte an element, converted to x's type in registers and multiplied on the tensor cores with FP32
accumulation; the per-channel scale multiplies the accumulator. Activations stay in their own type (no
per-token quantization), so at small M the kernel reads half of what a BF16 matmul reads and nothing more.

Tiles are "swapped" for small M: each program computes acc [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @
x_tile.T [BLOCK_K, BLOCK_M], so the weight fills the MMA's large dimension and the few activation rows its
small one (BLOCK_M = M rounded up to a power of two, at least 16: the smallest tile tl.dot takes).
Split-K gives every SM work when N alone has too few tiles (N = 4096 is 64 tiles of 64 on 132 SMs): each split
writes FP32 partial sums and a second kernel adds them in a fixed order, so a row's result does not depend on
timing (no atomics), and the tile and split never depend on M.

`choose_config` picks a tile per (N, K, dtype) once: on CUDA outside graph capture it times a few candidates
on the device; otherwise it uses the heuristic. `reference` is the same product in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODES = (FP8, torch.int8, torch.bfloat16, torch.float16)  # 16-bit weights: the same GEMV with scales of 1
MAX_M = 64  # rows one program holds at most (as the MMA's small dimension); larger batches belong to a GEMM


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                     stride_ys, CDT: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    row_ok = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN:  # N and every split's K range are whole tiles
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=row_ok, other=0.0)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=row_ok & k_ok[:, None], other=0.0)
        acc = tl.dot(w.to(CDT), xt.to(CDT), acc, input_precision=PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[:, None]
    y_ptrs = y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rn[:, None] < N) & row_ok)


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, numel, stride_ps, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * stride_ps + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(x_ptr, p_ptr, s_ptr, z_ptr, xs_ptr, y_ptr, M, N, K, k_per_split, stride_xm, stride_pn,
                      stride_sn, stride_ym, stride_ys, CDT: tl.constexpr, PREC: tl.constexpr, HAS_XS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """The same swapped-tile GEMV over 4-bit codes: each K step is one group of GROUP input channels (packed
    GROUP / 2 bytes a row: low nibble = even channel). The zero point and scale are factored out of the group's
    sum, sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k), so the codes go to the tensor cores as
    they are (0..15, exact in 16 bits) and only the [BLOCK_N, BLOCK_M] partial sums see the scale: the even and
    odd channels meet the matching columns of x (times its input scale) in two dots."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rj = tl.arange(0, HALF)
    n_ok = rn < N
    row_ok = rm[None, :] < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, GROUP):
        g = k // GROUP
        p = tl.load(p_ptr + rn[:, None].to(tl.int64) * stride_pn + (k // 2 + rj)[None, :], mask=n_ok[:, None],
                    other=0)
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0)
        z = tl.load(z_ptr + rn * stride_sn + g, mask=n_ok, other=0).to(tl.float32)
        ke = k + 2 * rj
        x_even = tl.load(x_ptr + rm[None, :] * stride_xm + ke[:, None], mask=row_ok & (ke < k_hi)[:, None],
                         other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + rm[None, :] * stride_xm + (ke + 1)[:, None],
                        mask=row_ok & ((ke + 1) < k_hi)[:, None], other=0.0).to(tl.float32)
        if HAS_XS:
            x_even = x_even * tl.load(xs_ptr + ke, mask=ke < k_hi, other=0.0)[:, None]
            x_odd = x_odd * tl.load(xs_ptr + ke + 1, mask=(ke + 1) < k_hi, other=0.0)[:, None]
        x_even = x_even.to(CDT)
        x_odd = x_odd.to(CDT)
        part = tl.dot((p & 15).to(CDT), x_even, input_precision=PREC)
        part = tl.dot((p >> 4).to(CDT), x_odd, part, input_precision=PREC)
        x_sum = tl.sum(x_even.to(tl.float32), axis=0) + tl.sum(x_odd.to(tl.float32), axis=0)
        acc += s[:, None] * (part - z[:, None] * x_sum[None, :])
    y_ptrs = y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self) -> str:
        return f"fp8gemv_{self.block_n}x{self.block_k}_split{self.split_k}_w{self.num_warps}_s{self.num_stages}"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int, waves: float = 2.0) -> int:
    """K splits that give about `waves` programs per SM, each split at least 4 K tiles long."""
    tiles = -(-n // block_n)
    want = max(1, round(waves * num_sms / tiles))
    return max(1, min(want, k // (4 * block_k)))


def heuristic_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    return GemvConfig(64, 128, split_for(n, k, 64, 128, num_sms))


def candidate_configs(n: int, k: int, num_sms: int) -> list[GemvConfig]:
    out = []
    for bn, bk, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (32, 256, 4, 4)):
        for waves in (1.0, 2.0, 4.0):
            c = GemvConfig(bn, bk, split_for(n, k, bn, bk, num_sms, waves), warps, stages)
            if c not in out:
                out.append(c)
    return out


def check(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float16, bfloat16 or float32 tensor, got {x.dtype} {list(x.shape)}")
    if codes.dtype not in CODES or codes.dim() != 2 or codes.shape[1] != x.shape[1]:
        raise ValueError(f"codes must be float8_e4m3fn, int8, bfloat16 or float16 [N, K={x.shape[1]}], got "
                         f"{codes.dtype} {list(codes.shape)}")
    if scale.numel() != codes.shape[0]:
        raise ValueError(f"scale must have N = {codes.shape[0]} elements, got {scale.numel()}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"fp8_gemv takes at most {MAX_M} rows, got {x.shape[0]}")


def fp8_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, config: GemvConfig | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 64, K] @ (codes [N, K] FP8 or INT8 * scale [N]).T -> [M, N] in x's dtype (into `out` when given)."""
    check(x, codes, scale)
    M, K = x.shape
    N = codes.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    scale = scale.reshape(-1)
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        scale = scale.float().contiguous()
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if y.shape != (M, N) or y.stride(1) != 1:
        raise ValueError(f"out must be [{M}, {N}] with unit column stride, got {list(y.shape)} {y.stride()}")
    if M == 0 or N == 0:
        return y
    cfg = config or choose_config(N, K, x.dtype, x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(K, k_per_split)
    even = N % cfg.block_n == 0 and K % k_per_split == 0
    cdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    target = y if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(N, cfg.block_n), splits)](
        x, codes, scale, target, M, N, K, k_per_split, x.stride(0), codes.stride(0),
        N if splits > 1 else y.stride(0), M * N if splits > 1 else 0, CDT=cdt,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", EVEN=even, BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](target, y, M * N, M * N, SPLIT_K=splits, BLOCK=block)
    return y


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              input_scale: torch.Tensor | None = None, group: int = 128, config: GemvConfig | None = None
              ) -> torch.Tensor:
    """(x [M <= 64, K] * input_scale) @ W.T for kiln.llm.quantize's INT4 layout: packed uint8 [N, G * group / 2]
    (low nibble = even input channel), scale FP32 [N, G], zero uint8 [N, G], W = (code - zero) * scale per group
    of `group` input channels. Returns [M, N] in x's dtype."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.shape[0] > MAX_M:
        raise ValueError(f"x must be a 2-D float16, bfloat16 or float32 tensor of at most {MAX_M} rows, got "
                         f"{x.dtype} {list(x.shape)}")
    M, K = x.shape
    N, G = scale.shape
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (N, G * group // 2) or G != -(-K // group):
        raise ValueError(f"packed must be uint8 [N, G * {group} / 2] with G = ceil(K / {group}) = "
                         f"{-(-K // group)}, got {packed.dtype} {list(packed.shape)} and scales {list(scale.shape)}")
    if tuple(zero.shape) != (N, G):
        raise ValueError(f"zero must be [{N}, {G}], got {list(zero.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    packed, scale, zero = packed.contiguous(), scale.float().contiguous(), zero.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or heuristic_config(N, K, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), group) * group
    splits = triton.cdiv(K, k_per_split)
    cdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    target = y if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    xs = input_scale.float().contiguous() if input_scale is not None else scale
    _int4_gemv_kernel[(triton.cdiv(N, cfg.block_n), splits)](
        x, packed, scale, zero, xs, target, M, N, K, k_per_split, x.stride(0), packed.stride(0), scale.stride(0),
        N if splits > 1 else y.stride(0), M * N if splits > 1 else 0, CDT=cdt,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", HAS_XS=input_scale is not None,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=cfg.block_n, GROUP=group,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](target, y, M * N, M * N, SPLIT_K=splits, BLOCK=block)
    return y


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product in torch, FP32, returned in x's dtype."""
    check(x, codes, scale)
    return (x.float() @ (codes.float() * scale.float().reshape(-1, 1)).t()).to(x.dtype)


# --- picking a tile on the device ------------------------------------------------------------------------------

_CHOSEN: dict = {}


def _time_config(cfg: GemvConfig, x, weights, scale, reps: int = 4) -> float:
    """Milliseconds a call, cycling through `weights` (together larger than L2, as a step's layers are)."""
    fp8_gemv(x, weights[0], scale, cfg)  # compile outside the timing
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for w in weights:
            fp8_gemv(x, w, scale, cfg)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * len(weights))


def choose_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The tile for an [n, k] weight: timed on the device once per shape (CUDA, not capturing a graph), else
    the heuristic. The choice never depends on M, so a row's result does not depend on its batch."""
    key = (n, k, dtype, str(device))
    cfg = _CHOSEN.get(key)
    if cfg is not None:
        return cfg
    sms = _num_sms(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return heuristic_config(n, k, sms)
    copies = max(2, -(-(256 << 20) // (n * k)))  # 256 MiB of weights: L2 cannot hold them
    weights = [torch.zeros((n, k), dtype=FP8, device=device) for _ in range(copies)]
    scale = torch.ones(n, dtype=torch.float32, device=device)
    x = torch.zeros((1, k), dtype=dtype, device=device)
    timed = {}
    for c in candidate_configs(n, k, sms):
        try:
            timed[c] = _time_config(c, x, weights, scale)
        except Exception:  # noqa: BLE001, S112 - a tile this Triton cannot compile for the device: not a candidate
            continue
    cfg = min(timed, key=timed.get) if timed else heuristic_config(n, k, sms)
    _CHOSEN[key] = cfg
    return cfg
