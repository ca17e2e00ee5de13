"""Triton tactics for the heavy fused layers: GEMM, implicit-GEMM convolution, flash attention.

Each kernel configuration (tile sizes, warps, pipeline stages) is its own tactic, so
the builder's timer picks the configuration per layer and shape on the target GPU:
  FusedGemm  triton_gemm_<BM>x<BN>x<BK>_w<warps>_s<stages>   kiln/kernels/gemm.py
  FusedConv  triton_conv_<BM>x<BN>x<BK>_w<warps>_s<stages>   kiln/kernels/conv.py
  FusedConv  triton_conv_splitk_s<slices>_<BM>x<BN>x<BK>_w<warps>_s<stages>  kiln/kernels/splitk_conv.py,
             K split over the slices, summed with atomics; from level 3, few-tile deep-K layers only
  PooledGemm triton_pooled_gemv_n<BN>_k<BK>_w<warps>        kiln/kernels/pooled_gemm.py, batch <= 8; level 3
  Attention  triton_flash_m<BM>_n<BN>_w<warps>_s<stages>     kiln/kernels/attention.py
  QGemm      triton_qgemm_<BM>x<BN>x<BK>_w<warps>_s<stages>  gemm.py, INT8/FP8 (QUANT_CONFIGS)
  QConv      triton_qconv_<BM>x<BN>x<BK>_w<warps>_s<stages>  conv.py, INT8/FP8 (QUANT_CONFIGS)
  QConv      triton_qconv1x1_<BM>x<BN>x<BK>_w<warps>_s<stages>  1x1 convolutions as gemm.py GEMMs
  GemmSkipLayerNorm  triton_splitk_s<slices>_<BM>x<BN>x<BK>_w<warps>_s<stages>  kiln/kernels/splitk_gemm.py,
             the norm (layernorm.py) summing the slices; from level 3
A few float GEMM/convolution configurations from level 4, more at level 5 (each kernel's
CONFIGS level plus one, see _LEVEL_SHIFT); flash attention from the default level 3. The
quantized ones are offered at their QUANT_CONFIGS level (several from the default level 3):
they are the only integer/FP8 kernels most INT8/FP8 convolutions have, the alternative being
the float fallback (dequantized_conv).
applies() refuses what a kernel cannot run: non-CUDA tensors, other dtypes, FP8 below sm_89,
grouped or non-2-D convolutions, unsupported head dims, a configuration whose pipeline
would not fit in the GPU's shared memory, or a tile far larger than the problem
(more than 4x the padded M or N: a smaller configuration always covers it).
FP32 operands are offered only to "tf32" layers (TF32 Tensor Cores): an exact-FP32 tl.dot
(input_precision="ieee") runs on CUDA cores, does not beat cuBLAS/cuDNN, and takes 10-30 s
to compile per configuration; the kernels themselves still support it (tests use it).
"""

from __future__ import annotations

import functools

import torch

from . import layer_gemm, tactic


@functools.lru_cache(maxsize=None)
def _smem_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 101376)


def _fits(x: torch.Tensor, smem_bytes: int) -> bool:
    return smem_bytes <= _smem_limit(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _tile_fits(config, x: torch.Tensor, w: torch.Tensor, quant: bool) -> bool:
    """A GEMM/convolution configuration's pipeline fits shared memory (a quantized kernel stages 8-bit x tiles,
    whatever x arrives as)."""
    return _fits(x, config.smem_bytes(w.element_size() if quant else x.element_size(), w.element_size()))


def _dtype_ok(node, t: torch.Tensor) -> bool:
    """16-bit operands, or FP32 operands in a layer that allows TF32."""
    return t.dtype in (torch.float16, torch.bfloat16) or (t.dtype == torch.float32 and node.precision == "tf32")


def _not_oversized(block: int, extent: int) -> bool:
    """A tile no more than 4x the problem's extent rounded up to a power of two (at least 16)."""
    p = 16
    while p < extent:
        p *= 2
    return block <= 4 * p


def _precision_ok(node, args, quant: bool, n_dim: int) -> bool:
    """CUDA tensors in a precision the kernel runs: float layers' 16-bit (or TF32-allowed) operands;
    quantized layers' scales, any float x (the products are 8-bit), FP8 only on Ada/Hopper (sm_89+)."""
    from ..kernels import gemm

    x, w = args[0], args[1]
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_cuda and w.dim() > n_dim):
        return False
    if not quant:
        return _dtype_ok(node, x)
    if node.attr("qtype", "int8") == "fp8" and torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return gemm.scales_ok(args[2], args[3], w.shape[n_dim], x.device)


# --- FusedGemm / QGemm ----------------------------------------------------------
def _gemm_applies(config, quant: bool = False):
    def applies(node, args) -> bool:
        from ..kernels import gemm
        from ..ops.fused import writes_fp32

        x, w, b = layer_gemm.operands(node, args)[:3]
        if not _precision_ok(node, args, quant, 1) or writes_fp32(node):  # the kernel writes the compute type
            return False
        if not gemm.supports(x, w, b, node.attr("activation", ""), node.attr("qtype", "int8") if quant else ""):
            return False
        m = x.numel() // x.shape[-1]
        return (_tile_fits(config, x, w, quant) and _not_oversized(config.block_m, m)
                and _not_oversized(config.block_n, w.shape[1]))

    return applies


def _gemm_run(config, quant: bool = False):
    def run(node, x, w, b=None):
        from ..kernels import gemm

        return gemm.gemm(x, w, b, node.attr("activation", ""), node.attr("activation_params", []),
                         config=config, precision=node.precision)

    def run_quant(node, x, w_q, x_scale, w_scale, b=None, y_scale=None):
        from ..kernels import gemm
        from ..ops.fused import float_type

        return gemm.gemm(x, w_q, b, node.attr("activation", ""), node.attr("activation_params", []), config=config,
                         qtype=node.attr("qtype", "int8"), x_scale=x_scale, w_scale=w_scale, y_scale=y_scale,
                         out_dtype=float_type(node, x))

    return run_quant if quant else run


# --- FusedConv / QConv ----------------------------------------------------------
# pointwise: a 1x1 QConv run by the GEMM kernel (kernels/conv.py pointwise_as_gemm).
def _conv_applies(config, quant: bool = False, pointwise: bool = False):
    def applies(node, args) -> bool:
        from ..kernels import conv

        x, w, b, z = layer_gemm.operands(node, args)[:4]
        if not _precision_ok(node, args, quant, 0):
            return False
        if not conv.supports(node, x, w, b, z, node.attr("qtype", "int8") if quant else ""):
            return False
        if pointwise and not conv.is_pointwise(node, x, w, z):
            return False
        oh, ow = conv.geometry(node, x, w)[3]
        return (_tile_fits(config, x, w, quant) and _not_oversized(config.block_m, x.shape[0] * oh * ow)
                and _not_oversized(config.block_n, w.shape[0]))

    return applies


def _conv_run(config, quant: bool = False, pointwise: bool = False):
    def run(node, x, w, b=None, z=None):
        from ..kernels import conv

        return conv.conv2d(node, x, w, b, z, config=config)

    def run_quant(node, x, w_q, x_scale, w_scale, b=None, z=None, y_scale=None, q_scale=None, z_scale=None):
        from ..kernels import conv
        from ..ops.fused import float_type

        kernel = conv.pointwise_as_gemm if pointwise else conv.conv2d
        return kernel(node, x, w_q, b, z, config=config, x_scale=x_scale, w_scale=w_scale, y_scale=y_scale,
                      out_dtype=float_type(node, x), q_scale=q_scale, z_scale=z_scale)

    return run_quant if quant else run


def _conv_splitk_applies(cfg):
    def applies(node, args) -> bool:
        from ..kernels import splitk_conv

        x, w, b, z = layer_gemm.operands(node, args)[:4]
        return (_precision_ok(node, args, False, 0) and splitk_conv.supports(node, x, w, b, z, cfg)
                and _fits(x, cfg.smem_bytes(x.element_size())) and _splitk_conv_worth_timing(node, x, w, cfg))

    return applies


def _splitk_conv_worth_timing(node, x: torch.Tensor, w: torch.Tensor, cfg) -> bool:
    """A channel-block convolution with fewer output tiles than the GPU has SMs and a deep K (ResNet-50's
    layer2-4 convolutions at batch 1)."""
    import triton

    from ..kernels import conv

    oh, ow = conv.geometry(node, x, w)[3]
    tiles = triton.cdiv(x.shape[0] * oh * ow, cfg.block_m) * triton.cdiv(w.shape[0], cfg.block_n)
    k = w.shape[1] * w.shape[2] * w.shape[3]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    # unsplit, fewer tiles than SMs leave SMs idle; K >= 512: 8+ iterations of 64 to share out.
    return x.shape[1] >= conv.FLAT_BELOW_C and tiles < sms and k >= 512


def _conv_splitk_run(cfg):
    def run(node, x, w, b=None, z=None):
        from ..kernels import splitk_conv

        return splitk_conv.conv2d_splitk(node, x, w, b, z, config=cfg)

    return run


# --- Attention ------------------------------------------------------------------
def _flash_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import attention

        q, k, v = args[0], args[1], args[2]
        mask = args[3] if len(args) > 3 else None
        fp8 = len(args) > 5 and args[5] is not None  # FP8 codes, converted to the float type as they are loaded
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not q.is_cuda:
            return False
        if not (fp8 and node.attr("float_type") in ("float16", "bfloat16")) and not _dtype_ok(node, q):
            return False
        if not attention.supports(q, k, v, mask, bool(node.attr("k_transposed", 0)), fp8=fp8):
            return False
        return (_fits(q, config.smem_bytes(q.shape[-1], v.shape[-1], max(q.element_size(), 2)))
                and _not_oversized(config.block_m, q.shape[-2]))

    return applies


def _flash_run(config):
    def run(node, q, k, v, mask=None, y_scale=None, qkv_scale=None):
        from ..kernels import attention
        from ..ops.fused import float_type

        return attention.flash_attention(q, k, v, mask, node.attr("scale", None), bool(node.attr("k_transposed", 0)),
                                         bool(node.attr("nan_guard", 0)), precision=node.precision, config=config,
                                         y_scale=y_scale, qtype=node.attr("qtype", "int8"), qkv_scale=qkv_scale,
                                         float_type=float_type(node, q))

    return run


def _splitk_applies(cfg):
    def applies(node, args):
        from .triton_tactics import gemm_ln_ok

        x = args[0]
        # Small M only: cuBLAS already wins at M = 512 (BERT's shapes; see docs/design/tactic-levels.md).
        return (gemm_ln_ok(node, args) and x.dtype in (torch.float16, torch.bfloat16)
                and _fits(x, cfg.smem_bytes(x.element_size())) and _flat_rows(x) is not None
                and x.numel() // x.shape[-1] <= 512)
    return applies


def _flat_rows(x: torch.Tensor):
    """x as [M, K] without a copy, or None."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _splitk_run(cfg):
    def run(node, x, w, bias, skip, gamma, beta=None):
        from ..kernels import layernorm, splitk_gemm
        from ..ops.fused import writes_fp32

        parts = splitk_gemm.partial_products(_flat_rows(x), w, cfg)
        return layernorm.partials_layernorm(parts, bias, skip, gamma.to(skip.dtype),
                                            beta.to(skip.dtype) if beta is not None else None,
                                            node.attr("epsilon", 1e-5),
                                            write_sum=bool(node.outputs[1:] and node.outputs[1]),
                                            y_dtype=torch.float32 if writes_fp32(node) else None)
    return run


def _pooled_gemv_applies(node, args) -> bool:
    """Every configuration takes the same layers: the grid adapts to the shape."""
    from ..kernels import pooled_gemm

    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return isinstance(x, torch.Tensor) and x.is_cuda and pooled_gemm.supports(x, w, b, node.attr("activation", ""))


def _pooled_gemv_run(cfg):
    def run(node, x, w, b=None):
        from ..kernels import pooled_gemm
        from ..ops.fused import writes_fp32

        out_dtype = torch.float32 if writes_fp32(node) else x.dtype
        return pooled_gemm.pooled_gemv(x, w, b, node.attr("activation", ""), node.attr("activation_params", []),
                                       config=cfg, out_dtype=out_dtype)

    return run


# Float GEMM/convolution tiles are offered one level above their CONFIGS level: they gain a few percent on
# ResNet-50 for a much longer cold build (see docs/design/tactic-levels.md).
_LEVEL_SHIFT = 1


def _register() -> None:
    from ..kernels import attention, conv, gemm, pooled_gemm, splitk_conv, splitk_gemm

    def lvl(level):
        return min(5, level + _LEVEL_SHIFT)

    for cfg, level in gemm.CONFIGS:
        tactic("FusedGemm", f"triton_gemm_{cfg.name}", _gemm_applies(cfg), level=lvl(level))(_gemm_run(cfg))
    for cfg, level in conv.CONFIGS:
        tactic("FusedConv", f"triton_conv_{cfg.name}", _conv_applies(cfg), level=lvl(level))(_conv_run(cfg))
    for cfg in splitk_conv.CONFIGS:
        tactic("FusedConv", f"triton_conv_splitk_{cfg.name}", _conv_splitk_applies(cfg),
               level=3)(_conv_splitk_run(cfg))
    for cfg, level in attention.CONFIGS:  # at their own level: cuDNN's SDPA adds a memset per call
        tactic("Attention", f"triton_flash_{cfg.name}", _flash_applies(cfg), level=level)(_flash_run(cfg))
    for cfg, level in gemm.QUANT_CONFIGS:
        tactic("QGemm", f"triton_qgemm_{cfg.name}", _gemm_applies(cfg, True), level=level)(_gemm_run(cfg, True))
    for cfg, level in conv.QUANT_CONFIGS:
        tactic("QConv", f"triton_qconv_{cfg.name}", _conv_applies(cfg, True), level=level)(_conv_run(cfg, True))
    for cfg, level in gemm.QUANT_CONFIGS:  # 1x1 convolutions through the GEMM kernel
        tactic("QConv", f"triton_qconv1x1_{cfg.name}", _conv_applies(cfg, True, pointwise=True),
               level=level)(_conv_run(cfg, True, pointwise=True))
    for cfg in pooled_gemm.CONFIGS:
        tactic("PooledGemm", f"triton_pooled_gemv_{cfg.name}", _pooled_gemv_applies, level=3)(_pooled_gemv_run(cfg))
    for cfg in splitk_gemm.CONFIGS:
        tactic("GemmSkipLayerNorm", f"triton_splitk_{cfg.name}", _splitk_applies(cfg), level=3)(_splitk_run(cfg))


try:
    import triton  # noqa: F401
except ImportError:  # no Triton here: these tactics are not offered
    pass
else:
    _register()
