"""Representativeness: clipping rates by hand, a representative set, and sets too small or too uniform."""

import warnings

import numpy as np
import pytest

from kiln.quant import Calibration, CalibrationWarning, calibrate, check_coverage
from kiln.quant.coverage import js_divergence

from . import batches, digits, digits_engine, relu_model


def test_clip_rates_by_hand():
    rng = np.random.default_rng(0)
    calib = rng.uniform(-1, 1, (200, 4)).astype(np.float32)
    calib[0] = [-1, 1, -1, 1]  # the calibrated range is exactly [-1, 1]
    cal = calibrate(relu_model(), batches(calib, 50), method="minmax", device="cpu", progress=False)
    assert cal.amax == {"x": 1.0, "y": 1.0}
    val = rng.uniform(-0.9, 0.9, (100, 4)).astype(np.float32)
    val[:5], val[5:10] = 2.0, -2.0  # 10% of x beyond +-1; of y = relu(x) only the +2 rows (5%)
    report = check_coverage(cal, relu_model(), batches(val, 25), device="cpu")
    x, y = report.tensor("x"), report.tensor("y")
    assert (x.count, x.clip_rate, x.out_of_range_rate, x.calib_clip_rate) == (400, 0.1, 0.1, 0.0)
    assert (y.clip_rate, y.out_of_range_rate) == (0.05, 0.05)
    assert (x.val_min, x.val_max) == (-2.0, 2.0)
    assert x.flags and y.flags and not report.ok
    assert any("validation clips 10% of values at amax 1" in f for f in x.flags)
    assert "2 tensor(s) are not covered" in report.flags[-1]
    assert not report.too_small and not report.too_uniform
    assert "x" in report.render() and report.to_json()["ok"] is False

    inside = check_coverage(cal, relu_model(), {"x": calib[1:100] * 0.5}, device="cpu")
    assert inside.ok and inside.tensor("x").clip_rate == 0.0, inside.render()


def test_a_representative_set_passes():
    d = digits()
    engine = digits_engine(hi=128)
    cal = calibrate(engine, d.calib_path, method="entropy", progress=False)
    report = check_coverage(cal, engine, d.data_path)
    assert report.val_samples == d.samples
    assert report.ok, report.render()
    assert {t.name for t in report.tensors} == set(cal.tensors)
    for t in report.tensors:
        assert t.clip_rate < 0.01 and t.hist_distance < 0.05
    # The same check from the calibration read back from its JSON form.
    again = check_coverage(Calibration.load(_saved(cal)), engine, d.data_path)
    assert [t.clip_rate for t in again.tensors] == [t.clip_rate for t in report.tensors]


def _saved(cal):
    import tempfile

    path = tempfile.mkdtemp(prefix="kiln-quant-") + "/cal.json"
    cal.save(path)
    return path


def test_too_small_and_too_uniform_sets_are_flagged():
    d = digits()
    engine = digits_engine(hi=128)
    with np.load(d.calib_path) as z:
        images = z["image"]
    with pytest.warns(CalibrationWarning):
        small = calibrate(engine, {"image": images[:20]}, method="minmax", progress=False)
    report = check_coverage(small, engine, d.data_path)
    assert report.too_small and not report.too_uniform
    assert "too small: 20 samples" in report.flags[0]

    rng = np.random.default_rng(0)
    dim = int(np.abs(images).reshape(len(images), -1).max(1).argmin())  # the image whose pixels peak lowest
    same = np.repeat(images[dim:dim + 1], 150, axis=0) + rng.normal(0, 1e-3, (150, 1, 8, 8)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # 150 samples: enough, but all alike
        uniform = calibrate(engine, {"image": same}, method="entropy", progress=False)
    report = check_coverage(uniform, engine, d.data_path)
    assert report.too_uniform and not report.too_small
    assert any("too uniform for input 'image'" in f and "barely differ" in f for f in report.flags)
    # One image's 64 pixel values make a spiky histogram, and brighter images clip at its amax.
    image = report.tensor("image")
    assert image.clip_rate > 0.05 and image.hist_distance > 0.1
    assert any("validation clips" in f for f in image.flags) and any("histogram differs" in f for f in image.flags)
    logits = report.tensor("logits")
    assert logits.out_of_range_rate > 0.01 and logits.flags
    assert len(report.flagged) >= 3

    dupes = calibrate(engine, {"image": np.repeat(images[:10], 15, axis=0)}, method="minmax", progress=False)
    report = check_coverage(dupes, engine, d.data_path)
    assert any("only 10 distinct of 150 rows" in f for f in report.flags)


def test_js_divergence_by_hand():
    assert js_divergence([1, 2, 3], [2, 4, 6]) == 0.0
    assert js_divergence([1, 0], [0, 1]) == 1.0
    # p = [.5, .5], q = [1, 0], m = [.75, .25]: (KL(p||m) + KL(q||m)) / 2
    kl_p = 0.5 * np.log2(0.5 / 0.75) + 0.5 * np.log2(0.5 / 0.25)
    kl_q = np.log2(1 / 0.75)
    assert js_divergence([1, 1], [1, 0]) == pytest.approx((kl_p + kl_q) / 2)
