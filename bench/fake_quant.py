"""A fake-quantized PyTorch reference for the zoo's INT8/FP8 rows: what 8-bit rounding alone costs a model.

Kiln's 8-bit engines quantize the inputs of convolutions and linear layers per tensor (an amax from entropy
calibration over the calibration set) and their weights per output channel (max |w|). This module applies the
same rounding to an eager PyTorch model (nn.Conv1d/2d/3d, nn.Linear and transformers' Conv1D, GPT-2's linear
layer): input amaxes from kiln.quant's own entropy calibrator over the same calibration inputs, 2048-bin
histograms of |x| over [0, max |x|] as Kiln's calibration takes them. A random-weight network's 8-bit error
against FP32 can be large (an FP8 ResNet-18 on random images: 11% relative L2) whoever computes it; an engine
whose error is near this reference's is rounding as designed, one far above it has a bug.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kiln.quant.calibrators import DEFAULT_BINS, FP8_E4M3_MAX, INT8_MAX, EntropyCalibrator


def _layers(module: nn.Module) -> list[tuple[nn.Module, int]]:
    """(layer, the weight's output-channel axis) of every layer an 8-bit engine quantizes."""
    out = []
    for m in module.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
            out.append((m, 0))
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # transformers' GPT-2 layer: weight [in, out]
            out.append((m, 1))
    return out


def _round(x: torch.Tensor, amax, kind: str) -> torch.Tensor:
    if kind == "int8":
        scale = amax / INT8_MAX
        return (x / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale
    scale = amax / FP8_E4M3_MAX
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _per_channel(w: torch.Tensor, axis: int, kind: str) -> torch.Tensor:
    moved = w.movedim(axis, 0)
    amax = moved.abs().reshape(moved.shape[0], -1).amax(1).clamp_min(1e-8)
    return _round(moved, amax.view(-1, *([1] * (moved.dim() - 1))), kind).movedim(0, axis)


def _input_amax(module: nn.Module, layers, calib_args: list[tuple]) -> dict[int, float]:
    """Entropy amax of each layer's input over the calibration inputs (two passes: max, then histograms)."""
    peaks: dict[int, float] = {}
    hists: dict[int, torch.Tensor] = {}

    def seen_max(layer, args):
        peaks[id(layer)] = max(peaks.get(id(layer), 0.0), float(args[0].detach().abs().max()))

    def seen_hist(layer, args):
        top = peaks[id(layer)]
        h = torch.histc(args[0].detach().float().abs(), DEFAULT_BINS, 0.0, top) if top > 0 else None
        if h is not None:
            hists[id(layer)] = hists[id(layer)] + h if id(layer) in hists else h

    for hook in (seen_max, seen_hist):
        handles = [m.register_forward_pre_hook(hook) for m, _ in layers]
        try:
            with torch.no_grad():
                for args in calib_args:
                    module(*args)
        finally:
            for h in handles:
                h.remove()
    calibrator = EntropyCalibrator()
    return {k: calibrator.amax(top, hists[k].cpu().numpy(), top) if k in hists else top for k, top in peaks.items()}


def fake_quant_outputs(module: nn.Module, args: tuple, calib_args: list[tuple], kind: str) -> list:
    """The module's outputs on `args` with its layers' inputs and weights rounded to `kind` ("int8"/"fp8"),
    input scales calibrated on `calib_args` (argument tuples like `args`). `module` is left as it was."""
    module = copy.deepcopy(module).eval()
    layers = _layers(module)
    amax = _input_amax(module, layers, calib_args)
    with torch.no_grad():
        for m, axis in layers:
            m.weight.copy_(_per_channel(m.weight, axis, kind))
    handles = [m.register_forward_pre_hook(
        lambda layer, a: (_round(a[0], max(amax.get(id(layer), 0.0), 1e-8), kind), *a[1:])) for m, _ in layers]
    try:
        with torch.no_grad():
            return module(*args)
    finally:
        for h in handles:
            h.remove()
