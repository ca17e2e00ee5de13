"""cuDNN convolutions with cuDNN's own algorithm search (torch.backends.cudnn.benchmark) instead of its heuristic:
  FusedConv, Conv  cudnn_conv_benchmarked   F.conv2d with the search on, then the residual add and activation in
                   place (as library.py's cudnn_conv_inplace_epilogue does)

cuDNN's heuristic picks one algorithm per shape without running any; for a few shapes it picks badly (MobileNetV3's
3x3 stride-2 stem of 16 filters on a zero-padded 4-channel image runs a grouped direct kernel many times slower than
its other convolutions). With benchmark on, torch times cuDNN's candidates on the first call of each shape and
layout and keeps the winner for the process: the build's first call of the tactic does the search, the engine's
warm-up before its CUDA graph capture finds it kept (or searches again in a new process), and the captured graph
replays that algorithm. The flag is set around the call only, so the rest of the process keeps its own setting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tactic
from .library import _conv2d_geometry, _cuda_conv, conv_epilogue


def _conv_benchmarked(x, w, b, geometry):
    s, p, d, g = geometry
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return F.conv2d(x, w, b, s, p, d, g)
    finally:
        torch.backends.cudnn.benchmark = before


def _applies(node, args) -> bool:
    x = args[0]
    return (isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and _cuda_conv(node, args) and torch.backends.cudnn.is_available())


def cudnn_conv_benchmarked(node, x, w, b=None, z=None):
    return conv_epilogue(node, _conv_benchmarked(x, w, b, _conv2d_geometry(node, x, w)), z)


tactic("FusedConv", "cudnn_conv_benchmarked", _applies)(cudnn_conv_benchmarked)
tactic("Conv", "cudnn_conv_benchmarked", _applies, domain="")(cudnn_conv_benchmarked)
