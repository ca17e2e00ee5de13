"""Triton tactics for the layers of depthwise / squeeze-excite CNNs (MobileNet, EfficientNet, MobileViT), offered
from the default level 3 and timed against cuDNN's kernels:
  FusedConv, Conv     triton_depthwise_<cfg>     kernels/depthwise_conv.py: group == C == OC convolutions, with the
                      layer's bias, residual and activation in the same kernel
  FusedConv, Conv     triton_conv_narrow_<BM>x<BN>x<BK>_w<warps>_s<stages>  kernels/conv.py's implicit GEMM in tiles
                      for few input channels (K walked flat) and at most 64 output channels: an RGB stem. cuDNN's
                      heuristic ran MobileNetV3's and MobileViT's 16-filter stem over four channels on a slow grouped
                      direct kernel (docs/design/se-cnn.md), and the wide tiles of triton_conv_* (level 4) waste
                      most of each program on 16 channels.
  FusedConv, Conv     triton_conv1x1_rows_<BM>x<BN>x<BK>_w<warps>_s<stages>  1x1 convolutions of at most 256 pixel rows
                      as kernels/gemm.py GEMMs with the activation in the epilogue: a squeeze-excite block's fully
                      connected layers on its pooled map, whose channel counts (4, 6, 10, ...) TMA cannot take
  FusedConv           triton_tma_conv_act_<BH>x<BW>x<BN>x<BK>_w<warps>_s<stages>  triton_tma.py's TMA convolution
                      (Hopper) from the default level for layers with an activation other than ReLU: cuDNN
                      leaves SiLU / HardSwish to a pass of its own, which the 16-bit TMA tiles (level 4 otherwise:
                      docs/design/tma-conv.md) apply in their epilogue
  ReduceMean, GlobalAveragePool  triton_spatial_mean_<cfg>  kernels/pool.py spatial_mean: the mean over H and W of
                      a 4-D tensor (a squeeze-excite block's pool)
"""

from __future__ import annotations

import torch

from . import tactic


def _conv_operands(args):
    """(x, w, b, z) of a FusedConv (x, w, b, z) or an ONNX Conv (x, w, b)."""
    args = list(args) + [None] * (4 - len(args))
    return args[0], args[1], args[2], args[3]


def _depthwise_applies(node, args) -> bool:
    from ..kernels import depthwise_conv

    x, w, b, z = _conv_operands(args)
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_cuda
            and depthwise_conv.supports(node, x, w, b, z))


def _depthwise_run(config):
    def run(node, x, w, b=None, z=None):
        from ..kernels import depthwise_conv

        return depthwise_conv.conv2d(node, x, w, b, z, config=config)

    return run


def _narrow_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv
        from .triton_gemm import _not_oversized, _tile_fits

        x, w, b, z = _conv_operands(args)
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_cuda):
            return False
        if x.dtype not in (torch.float16, torch.bfloat16) or not conv.supports(node, x, w, b, z):
            return False
        oh, ow = conv.geometry(node, x, w)[3]
        return (x.shape[1] < conv.FLAT_BELOW_C and w.shape[0] <= 64 and config.block_n <= max(16, 2 * w.shape[0])
                and _not_oversized(config.block_m, x.shape[0] * oh * ow) and _tile_fits(config, x, w, False))

    return applies


def _narrow_run(config):
    def run(node, x, w, b=None, z=None):
        from ..kernels import conv

        return conv.conv2d(node, x, w, b, z, config=config)

    return run


FEW_ROWS = 256  # pixel rows (N * H * W) up to which triton_conv1x1_rows_* are offered


def _few_rows_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv, gemm

        x, w, b, z = _conv_operands(args)
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_cuda):
            return False
        if x.dtype not in (torch.float16, torch.bfloat16) or not conv.is_pointwise(node, x, w, z):
            return False
        rows = x.numel() // x.shape[1]
        return (rows <= FEW_ROWS and gemm.supports(conv.pixel_rows(x), w.reshape(w.shape[0], -1).t(), b,
                                                   node.attr("activation", ""))
                and config.block_m <= max(16, 2 * rows))

    return applies


def _few_rows_run(config):
    def run(node, x, w, b=None, z=None):
        from ..kernels import conv

        return conv.pointwise_as_gemm(node, x, w, b, z, config=config)

    return run


def _tma_act_applies(config):
    from .triton_tma import _conv_applies

    tma_applies = _conv_applies(config)

    def applies(node, args) -> bool:
        return node.attr("activation", "") not in ("", "Relu") and tma_applies(node, args)

    return applies


def _spatial_mean_applies(node, args) -> bool:
    from ..kernels import pool
    from ..ops.reduce import _dims

    x = args[0]
    if not (isinstance(x, torch.Tensor) and x.is_cuda and pool.spatial_mean_supports(x)):
        return False
    if node.op_type == "GlobalAveragePool":
        return True
    axes = args[1] if len(args) > 1 else None
    return _dims(node, x, axes) == (2, 3)


def _spatial_mean_run(config):
    def run(node, x, axes=None):
        from ..kernels import pool

        keep = node.op_type == "GlobalAveragePool" or bool(node.attr("keepdims", 1))
        return pool.spatial_mean(x, keepdim=keep, config=config)

    return run


def _register() -> None:
    from ..kernels import conv, depthwise_conv, pool

    for cfg in depthwise_conv.CONFIGS:
        for op, domain in (("FusedConv", "kiln"), ("Conv", "")):
            tactic(op, f"triton_depthwise_{cfg.name}", _depthwise_applies, domain=domain, level=3)(_depthwise_run(cfg))
    for cfg in conv.NARROW_CONFIGS:
        for op, domain in (("FusedConv", "kiln"), ("Conv", "")):
            tactic(op, f"triton_conv_narrow_{cfg.name}", _narrow_applies(cfg), domain=domain,
                   level=3)(_narrow_run(cfg))
    for cfg in conv.FEW_ROWS_POINTWISE_CONFIGS:
        for op, domain in (("FusedConv", "kiln"), ("Conv", "")):
            tactic(op, f"triton_conv1x1_rows_{cfg.name}", _few_rows_applies(cfg), domain=domain,
                   level=3)(_few_rows_run(cfg))
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (Triton >= 3.4)
    except ImportError:  # no host-side TMA descriptors: triton_tma.py offers none either
        pass
    else:
        from ..kernels import tma_conv
        from .triton_tma import _conv_run

        for cfg, _ in tma_conv.CONFIGS:
            tactic("FusedConv", f"triton_tma_conv_act_{cfg.name}", _tma_act_applies(cfg), level=3)(_conv_run(cfg))
    for cfg in pool.MEAN_CONFIGS:
        for op in ("ReduceMean", "GlobalAveragePool"):
            tactic(op, f"triton_spatial_mean_{cfg.name}", _spatial_mean_applies, domain="", level=3)(
                _spatial_mean_run(cfg))


try:
    import triton  # noqa: F401
except ImportError:  # no Triton here: these tactics are not offered
    pass
else:
    _register()
