"""Tactics on the warp-specialized Gluon convolution (kiln/kernels/ws_conv.py), Hopper only:
  QConv  gluon_ws_qconv_<BH>x<BW>x<BN>x<BK>_s<stages>_x<programs an SM>  INT8/FP8 convolutions with an 8-bit
                                                                           output; not 1x1 stride 1
Offered beside tma_conv's tiles (tactics/triton_tma.py) at the same level: the builder times both and keeps the
faster at each layer. Not offered where Triton has no Gluon.
"""

from __future__ import annotations

from . import layer_gemm, tactic


def _applies(config):
    def applies(node, args) -> bool:
        from ..kernels import conv, ws_conv
        from .triton_tma import _device_ok, _operands_ok

        x, w, b, z, y_scale, q_scale, _ = layer_gemm.operands(node, args)
        if not _operands_ok(node, args, x, w) or w.dim() != 4 or conv.is_pointwise(node, x, w, z):
            return False  # 1x1 stride 1 is the TMA GEMM's
        if not ws_conv.supports(node, x, w, b, z, y_scale, q_scale, config):
            return False
        return _device_ok(x, config.smem_bytes(min(config.block_k, x.shape[1])))

    return applies


def _run(config):
    def run(node, *args):
        from ..kernels import ws_conv

        x, w, b, _, y_scale, _, _ = layer_gemm.operands(node, args)
        return ws_conv.conv2d(node, x, w, b, config, args[2], args[3], y_scale)

    return run


try:
    from ..kernels import ws_conv
except ImportError:  # no Triton, or one without Gluon's Hopper module: not offered
    pass
else:
    for cfg, level in ws_conv.CONFIGS:
        tactic("QConv", f"gluon_ws_qconv_{cfg.name}", _applies(cfg), level=level)(_run(cfg))
