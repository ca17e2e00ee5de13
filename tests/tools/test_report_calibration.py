"""The report's calibration question on an INT8 engine: does the calibration set cover a validation set?"""

import numpy as np

import kiln
from kiln.tools.report import build_report

from ..quant import digits


def _int8(tmp_path, calib_rows):
    d = digits()
    calib = tmp_path / "calib.npz"
    np.savez(calib, image=calib_rows)
    cache = tmp_path / "calib.json"
    engine = kiln.build(str(d.onnx_path), kiln.BuildConfig(
        device="cpu", progress=False, int8=True, calib=str(calib), calib_cache=str(cache),
        profiles=[kiln.Profile({"image": ((1, 1, 8, 8), (32, 1, 8, 8), (360, 1, 8, 8))})]))
    return d, engine, cache


def test_representative_calibration_passes_the_coverage_question(tmp_path):
    d = digits()
    rows = np.load(d.calib_path)["image"]
    _, engine, cache = _int8(tmp_path, rows)
    rep = build_report(engine, reference=str(d.onnx_path), run_bench=False, calib_cache=str(cache),
                       calib_validation=str(d.data_path))
    assert engine.build_config["calibration"]["samples"] == len(rows)
    assert rep.calibration_status == "pass", rep.calibration


def test_a_tiny_uniform_calibration_set_is_flagged(tmp_path):
    d = digits()
    one = np.load(d.calib_path)["image"][:1]
    _, engine, cache = _int8(tmp_path, np.repeat(one, 4, axis=0))  # four copies of one image
    rep = build_report(engine, reference=str(d.onnx_path), run_bench=False, calib_cache=str(cache),
                       calib_validation=str(d.data_path))
    assert rep.calibration_status == "warn"
    assert "too small" in rep.calibration or "uniform" in rep.calibration
