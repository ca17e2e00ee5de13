"""Reduced precision: post-training calibration (INT8/FP8 scales), caches, representativeness checks.

    cal = kiln.quant.calibrate(model, "calib.npz", method="entropy")   # or "minmax", "percentile"
    cal.scales, cal.fp8_scales, cal.weight_scales
    cal.save("model.calib")             # TensorRT text cache; a .json path for the full JSON form
    kiln.quant.Calibration.load("model.calib")
    kiln.quant.check_coverage(cal, model, "validation.npz").render()
"""

from .cache import load as load_calibration
from .calibrate import Calibration, CalibrationWarning, TensorStats, calibrate
from .calibrators import (
    EntropyCalibrator,
    MinMaxCalibrator,
    PercentileCalibrator,
    WeightScale,
    entropy_amax,
    fp8_e4m3_scale,
    get_calibrator,
    int8_scale,
    per_channel_amax,
    percentile_amax,
    weight_scales,
)
from .coverage import CoverageReport, TensorCoverage, check_coverage

__all__ = [
    "Calibration", "CalibrationWarning", "CoverageReport", "EntropyCalibrator", "MinMaxCalibrator",
    "PercentileCalibrator", "TensorCoverage", "TensorStats", "WeightScale", "calibrate", "check_coverage",
    "entropy_amax", "fp8_e4m3_scale", "get_calibrator", "int8_scale", "load_calibration", "per_channel_amax",
    "percentile_amax", "weight_scales",
]
