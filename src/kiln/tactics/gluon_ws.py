"""Tactics on the warp-specialized Gluon kernels, Hopper only:
  QConv  gluon_ws_qconv_<BH>x<BW>x<BN>x<BK>_s<stages>_x<programs an SM>  kernels/ws_conv.py: INT8/FP8
         convolutions with an 8-bit output, not 1x1 stride 1
  QConv  gluon_ws_qconv1x1_<BM>x<BN>_s<stages>_x<programs an SM>  kernels/ws_gemm.py: INT8/FP8 1x1 stride-1
         convolutions with an 8-bit output and an 8-bit residual or none
  QGemm  gluon_ws_qgemm_<BM>x<BN>_s<stages>_x<programs an SM>  kernels/ws_gemm.py: INT8/FP8 GEMMs with an 8-bit
         output (BERT's QKV, and FFN1 with its GELU)
  QConv  gluon_halo_qconv3x3  kernels/halo_conv.py: INT8/FP8 64-channel 3x3 stride-1 convolutions of images at most
         64 pixels wide, a tile two whole output rows
Offered beside tma_conv's and tma_gemm's tiles (tactics/triton_tma.py) at the same level: the builder times them
all and keeps the fastest at each layer. Not offered where Triton has no Gluon.
"""

from __future__ import annotations

from . import layer_gemm, tactic


def _conv_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv, ws_conv
        from .triton_tma import _device_ok, _operands_ok

        x, w, b, z, y_scale, q_scale, _ = layer_gemm.operands(node, args)
        if not _operands_ok(node, args, x, w) or w.dim() != 4 or conv.is_pointwise(node, x, w, z):
            return False  # 1x1 stride 1 is ws_gemm's
        if not ws_conv.supports(node, x, w, b, z, y_scale, q_scale, config):
            return False
        return _device_ok(x, config.smem_bytes(x.shape[1], w.shape[2] * w.shape[3]))

    return applies


def _conv_run(config):
    def run(node, *args):
        from ..kernels import ws_conv

        x, w, b, _, y_scale, _, _ = layer_gemm.operands(node, args)
        return ws_conv.conv2d(node, x, w, b, config, args[2], args[3], y_scale)

    return run


def _gemm_applies(config):
    def applies(node, args) -> bool:
        from ..kernels import ws_gemm
        from .triton_tma import _device_ok, _operands_ok

        x, w, b, z, y_scale, q_scale, z_scale = layer_gemm.operands(node, args)
        if not _operands_ok(node, args, x, w) or not ws_gemm.supports(node, x, w, b, z, y_scale, q_scale, z_scale,
                                                                      config):
            return False
        k = ws_gemm.matrices(node, x, w, z)[1].shape[1]  # w's rows are [N, K] for a QGemm and a 1x1 QConv alike
        return _device_ok(x, config.smem_bytes(ws_gemm.block_k_for(k), z is not None))

    return applies


def _gemm_run(config):
    def run(node, *args):
        from ..kernels import ws_gemm

        x, w, b, z, y_scale, _, z_scale = layer_gemm.operands(node, args)
        return ws_gemm.matmul8(node, x, w, b, z, config, args[2], args[3], y_scale, z_scale)

    return run


def _halo_applies(node, args) -> bool:
    from ..kernels import halo_conv
    from .triton_tma import _device_ok, _operands_ok

    x, w, b, z, y_scale, q_scale, _ = layer_gemm.operands(node, args)
    if not _operands_ok(node, args, x, w) or not halo_conv.supports(node, x, w, b, z, y_scale, q_scale):
        return False
    return _device_ok(x, halo_conv.smem_bytes())


def _halo_run(node, *args):
    from ..kernels import halo_conv

    x, w, b, _, y_scale, _, _ = layer_gemm.operands(node, args)
    return halo_conv.conv2d(node, x, w, b, args[2], args[3], y_scale)


try:
    from ..kernels import halo_conv, ws_conv, ws_gemm  # noqa: F401 (halo_conv: importable, so offered)
except ImportError:  # no Triton, or one without Gluon's Hopper module: not offered
    pass
else:
    for cfg, level in ws_conv.CONFIGS:
        tactic("QConv", f"gluon_ws_qconv_{cfg.name}", _conv_applies(cfg), level=level)(_conv_run(cfg))
    for cfg, level in ws_gemm.CONFIGS:
        tactic("QConv", f"gluon_ws_qconv1x1_{cfg.name}", _gemm_applies(cfg), level=level)(_gemm_run(cfg))
        tactic("QGemm", f"gluon_ws_qgemm_{cfg.name}", _gemm_applies(cfg), level=level)(_gemm_run(cfg))
    tactic("QConv", "gluon_halo_qconv3x3", _halo_applies, level=3)(_halo_run)
