"""Tactics on the TMA GEMM (kiln/kernels/tma_gemm.py), Hopper (sm_90) and newer:
  FusedGemm  triton_tma_gemm_<BM>x<BN>x<BK>_w<warps>_s<stages>      16-bit GEMMs, from level 4
  FusedConv  triton_tma_conv1x1_<BM>x<BN>x<BK>_w<warps>_s<stages>   16-bit 1x1 convolutions as GEMMs
  QGemm      triton_tma_qgemm_<BM>x<BN>x<BK>_w<warps>_s<stages>     INT8/FP8 GEMMs
  QConv      triton_tma_qconv1x1_<BM>x<BN>x<BK>_w<warps>_s<stages>  INT8/FP8 1x1 convolutions as GEMMs
  FusedConv  triton_tma_conv_<BH>x<BW>x<BN>x<BK>_w<warps>_s<stages>  stride-1/2 convolutions (kernels/tma_conv.py),
  QConv      triton_tma_qconv_<BH>x<BW>x<BN>x<BK>_w<warps>_s<stages> their INT8/FP8 form; not 1x1 stride 1
Each configuration is offered at its CONFIGS / QUANT_CONFIGS level, except that float GEMMs start at
level 4: cuBLAS wins transformer-shaped FP16 GEMMs, so timing them by default would only cost build time
(see docs/design/tactic-levels.md).
"""

from __future__ import annotations

import torch

from . import layer_gemm, tactic


def _device_ok(x: torch.Tensor, smem_bytes: int) -> bool:
    """A Hopper-or-newer GPU (TMA) whose shared memory holds a configuration (triton_gemm's limit lookup)."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    from .triton_gemm import _fits

    return _fits(x, smem_bytes)


def _operands_ok(node, args, x, w) -> bool:
    """Tensor x and w, and a quantized layer's scales for w's output channels (a QGemm's [K, N], a QConv's
    [OC, C, ..])."""
    from ..kernels import gemm

    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return False
    out_channels = w.shape[1] if node.op_type == "QGemm" else w.shape[0]
    return not layer_gemm.qtype(node) or gemm.scales_ok(args[2], args[3], out_channels, x.device)


def _applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv, tma_gemm
        from ..ops.fused import writes_fp32

        x, w, b, z, _, q_scale, _ = layer_gemm.operands(node, args)
        if not _operands_ok(node, args, x, w) or writes_fp32(node):  # the kernel writes the compute type
            return False
        qtype = layer_gemm.qtype(node)
        if node.op_type in ("FusedConv", "QConv") and not conv.is_pointwise(node, x, w, z):
            return False
        mats = layer_gemm.as_gemm(node, x, w)
        if mats is None or not tma_gemm.supports(*mats, b, node.attr("activation", ""), qtype,
                                                 conv.pixel_rows(z) if z is not None and x.dim() == 4 else z):
            return False
        itemsize, z_itemsize = 1 if qtype else x.element_size(), z.element_size() if z is not None else 0
        single_loop = tma_gemm.one_loop(config, mats[1].shape[0], itemsize, z_itemsize)
        return _device_ok(x, tma_gemm.smem_bytes(config, itemsize, 1 + (q_scale is not None))
                          + tma_gemm.residual_bytes(config, z_itemsize, single_loop))

    return applies


def _run(config):
    def run(node, *args):
        from ..kernels import tma_gemm
        from ..ops.fused import float_type

        x, w, b, z, y_scale, q_scale, z_scale = layer_gemm.operands(node, args)
        qtype = layer_gemm.qtype(node)
        rows, w2 = layer_gemm.as_gemm(node, x, w)
        conv = node.op_type in ("FusedConv", "QConv")
        if conv and z is not None:
            from ..kernels.conv import pixel_rows
            z = pixel_rows(z)
        quant = dict(qtype=qtype, x_scale=args[2], w_scale=args[3], y_scale=y_scale, q_scale=q_scale,
                     z_scale=z_scale, out_dtype=float_type(node, x)) if qtype else {}
        ys = tma_gemm.gemm(rows, w2, b, node.attr("activation", ""), node.attr("activation_params", []),
                           config=config, z=z, **quant)
        if not conv:
            return ys
        from ..kernels.conv import pixels_as_nchw

        return pixels_as_nchw(ys, x)

    return run


def _conv_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv, tma_conv

        x, w, b, z, _, _, _ = layer_gemm.operands(node, args)
        if not _operands_ok(node, args, x, w) or w.dim() != 4:
            return False
        qtype = layer_gemm.qtype(node)
        if conv.is_pointwise(node, x, w, z) or not tma_conv.supports(node, x, w, b, z, config, qtype):
            return False  # 1x1 stride 1: the TMA GEMM's
        return _device_ok(x, config.smem_bytes(1 if qtype else x.element_size()))

    return applies


def _conv_run(config):
    def run(node, *args):
        from ..kernels import tma_conv
        from ..ops.fused import float_type

        x, w, b, z, y_scale, q_scale, z_scale = layer_gemm.operands(node, args)
        quant = dict(x_scale=args[2], w_scale=args[3], y_scale=y_scale, q_scale=q_scale, z_scale=z_scale,
                     out_dtype=float_type(node, x)) if layer_gemm.qtype(node) else {}
        return tma_conv.conv2d(node, x, w, b, z, config=config, **quant)

    return run


def _register() -> None:
    from ..kernels import tma_conv, tma_gemm

    for cfg, level in tma_gemm.CONFIGS:
        tactic("FusedGemm", f"triton_tma_gemm_{cfg.name}", _applies(cfg), level=max(4, level))(_run(cfg))
        tactic("FusedConv", f"triton_tma_conv1x1_{cfg.name}", _applies(cfg), level=level)(_run(cfg))
    for cfg, level in tma_gemm.QUANT_CONFIGS:
        tactic("QGemm", f"triton_tma_qgemm_{cfg.name}", _applies(cfg), level=level)(_run(cfg))
        tactic("QConv", f"triton_tma_qconv1x1_{cfg.name}", _applies(cfg), level=level)(_run(cfg))
    for cfg, level in tma_conv.CONFIGS:
        tactic("FusedConv", f"triton_tma_conv_{cfg.name}", _conv_applies(cfg), level=level)(_conv_run(cfg))
    for cfg, level in tma_conv.QUANT_CONFIGS:
        tactic("QConv", f"triton_tma_qconv_{cfg.name}", _conv_applies(cfg), level=level)(_conv_run(cfg))


try:
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (Triton >= 3.4)
except ImportError:  # no Triton, or one without host-side TMA descriptors: not offered
    pass
else:
    _register()
