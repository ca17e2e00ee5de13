"""cuDNN convolutions with their bias, residual add and activation in one generated pass after them
(kernels/conv_epilogue.py), offered from the default level 3 beside the tactics that leave those to torch:
  FusedConv, Conv  cudnn_conv_one_epilogue              F.conv2d without its bias (cuDNN's heuristic), then
                                                        act(y + b [+ z]) in place
  FusedConv, Conv  cudnn_conv_benchmarked_one_epilogue  the same after cuDNN's own algorithm search
                                                        (tactics/cudnn_benchmark.py)

torch adds a convolution's bias over a channels-last output on its generic strided kernel, and runs SiLU,
HardSwish or a residual add as passes of their own; a YOLO-style or MobileViT block's convolutions spent more
time in those passes than in cuDNN's kernels. Offered where the layer has a bias; the builder times them
against the others, so a layer keeps whichever is fastest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tactic
from .cudnn_benchmark import _conv_benchmarked
from .library import _conv2d_geometry, _cuda_conv, _out_hw

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _applies(node, args) -> bool:
    from ..kernels import conv_epilogue

    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    z = args[3] if len(args) > 3 else None
    if not (isinstance(x, torch.Tensor) and x.dtype in _FLOATS and b is not None and _cuda_conv(node, args)
            and torch.backends.cudnn.is_available()):
        return False
    shape = (x.shape[0], w.shape[0], *_out_hw(node, x, w))
    return b.device == x.device and conv_epilogue.supports(shape, x.dtype, b, z, node.attr("activation", ""),
                                                           node.attr("activation_params", []))


def _epilogue(node, y, b, z):
    from ..kernels import conv_epilogue

    return conv_epilogue.apply(y, b, z, node.attr("activation", ""), node.attr("activation_params", []))


def cudnn_conv_one_epilogue(node, x, w, b=None, z=None):
    s, p, d, g = _conv2d_geometry(node, x, w)
    return _epilogue(node, F.conv2d(x, w, None, s, p, d, g), b, z)


def cudnn_conv_benchmarked_one_epilogue(node, x, w, b=None, z=None):
    return _epilogue(node, _conv_benchmarked(x, w, None, _conv2d_geometry(node, x, w)), b, z)


try:
    import triton  # noqa: F401
except ImportError:  # no Triton here: the generated pass is not offered
    pass
else:
    for _op, _domain in (("FusedConv", "kiln"), ("Conv", "")):
        tactic(_op, "cudnn_conv_one_epilogue", _applies, domain=_domain, level=3)(cudnn_conv_one_epilogue)
        tactic(_op, "cudnn_conv_benchmarked_one_epilogue", _applies, domain=_domain, level=3)(
            cudnn_conv_benchmarked_one_epilogue)
