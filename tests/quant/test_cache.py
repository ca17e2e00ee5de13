"""Calibration caches: TensorRT's text format (exact float32 scales) and the JSON form."""

import re

import numpy as np
import pytest

from kiln.errors import ConfigError
from kiln.quant import Calibration, TensorStats, WeightScale, cache, calibrate

from . import batches, relu_model


def _cal(method="entropy", **amax):
    tensors = {}
    for name, a in amax.items():
        tensors[name] = TensorStats(name, amax=a)
    return Calibration(method=method, tensors=tensors)


def test_hex_encoding_by_hand():
    assert cache.float_to_hex(1.0) == "3f800000"
    assert cache.float_to_hex(0.5) == "3f000000"
    assert cache.float_to_hex(np.float32(1 / 127)) == "3c010204"
    assert cache.hex_to_float("3f800000") == 1.0
    assert cache.hex_to_float("0x3c010204") == float(np.float32(1 / 127))
    assert cache.hex_to_float("0") == 0.0  # short hex is zero-padded on the left


def test_trt_text_round_trip(tmp_path):
    cal = _cal(**{"input": 2.54, "conv1/relu:0": 0.123456789, "(Unnamed Layer* 3) [Convolution]_output": 1e-3,
                  "dead": 0.0})
    path = tmp_path / "model.calib"
    cal.save(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    assert lines[1] == f"input: {cache.float_to_hex(np.float32(2.54 / 127))}"
    assert all(re.fullmatch(r".+: [0-9a-f]{8}", ln) for ln in lines[1:])
    back = Calibration.load(path)
    assert back.method == "entropy"
    assert back.scales == cal.scales  # the same float32 scales, bit for bit
    assert back.fp8_scales == pytest.approx(cal.fp8_scales, rel=1e-6)
    assert list(back.scales) == list(cal.scales)


def test_reads_a_tensorrt_written_cache(tmp_path):
    text = ("TRT-8601-MinMaxCalibration\n"
            "input_tensor: 3c010204\n"
            "(Unnamed Layer* 0) [Convolution]_output: 3d000000\r\n"
            "scope/with: colon: 3e800000\n\n")
    path = tmp_path / "trt.cache"
    path.write_text(text)
    cal = Calibration.load(path)
    assert cal.method == "minmax" and cal.engine["trt_version"] == "8601"
    assert cal.scales == {"input_tensor": float(np.float32(1 / 127)),
                          "(Unnamed Layer* 0) [Convolution]_output": 0.03125, "scope/with: colon": 0.25}
    assert cal.amax["scope/with: colon"] == 0.25 * 127
    cal.save(tmp_path / "again.cache", format="trt")
    assert (tmp_path / "again.cache").read_text().splitlines()[1:] == [
        "input_tensor: 3c010204", "(Unnamed Layer* 0) [Convolution]_output: 3d000000", "scope/with: colon: 3e800000"]


def test_headers_per_method(tmp_path):
    for method, header in (("minmax", "MinMaxCalibration"), ("percentile", "PercentileCalibration")):
        _cal(method, x=1.0).save(tmp_path / f"{method}.cache")
        assert (tmp_path / f"{method}.cache").read_text().startswith(f"TRT-8601-{header}\n")
        assert Calibration.load(tmp_path / f"{method}.cache").method == method


def test_json_round_trip_keeps_everything(tmp_path):
    x = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    cal = calibrate(relu_model(), batches(x, 20), method="percentile", percentile=99.9, device="cpu",
                    progress=False)
    cal.weights["w"] = WeightScale("w", 0, np.array([0.5, 2.0], np.float32))
    path = tmp_path / "cal.json"
    cal.save(path)
    back = Calibration.load(path)
    assert (back.method, back.percentile, back.samples, back.num_bins) == ("percentile", 99.9, 100, 2048)
    assert back.amax == cal.amax and back.scales == cal.scales
    for name, s in cal.tensors.items():
        b = back.tensors[name]
        assert (b.min, b.max, b.count, b.zeros, b.hist_max) == (s.min, s.max, s.count, s.zeros, s.hist_max)
        np.testing.assert_array_equal(b.hist, s.hist)
    np.testing.assert_array_equal(back.weights["w"].scales, cal.weights["w"].scales)
    assert back.inputs == cal.inputs
    # The same calibration also writes a TensorRT cache whose scales match.
    cal.save(tmp_path / "cal.cache")
    assert Calibration.load(tmp_path / "cal.cache").scales == cal.scales


def test_bad_caches_are_refused(tmp_path):
    def load(text):
        p = tmp_path / "bad.cache"
        p.write_text(text)
        return Calibration.load(p)

    with pytest.raises(ConfigError, match="is empty"):
        load("")
    with pytest.raises(ConfigError, match="not a TensorRT calibration cache header"):
        load("x: 3f800000\n")
    with pytest.raises(ConfigError, match="line 2.*should be 'tensor_name: <hex float32 scale>'"):
        load("TRT-8601-EntropyCalibration2\nno scale here\n")
    with pytest.raises(ConfigError, match="line 2.*'zz' is not the hex of a float32"):
        load("TRT-8601-EntropyCalibration2\nx: zz\n")
    with pytest.raises(ConfigError, match="scale -1.0"):
        load("TRT-8601-EntropyCalibration2\nx: bf800000\n")
    with pytest.raises(ConfigError, match="not a Kiln calibration JSON"):
        load('{"tensors": {}}')
    with pytest.raises(ConfigError, match="does not exist"):
        Calibration.load(tmp_path / "missing.cache")
    with pytest.raises(ConfigError, match="'trt' or 'json'"):
        _cal(x=1.0).save(tmp_path / "x.cache", format="yaml")


def test_calibrate_reuses_a_cache_and_never_invents_scales(tmp_path):
    x = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    path = tmp_path / "relu.cache"
    with pytest.raises(ConfigError, match="needs data.*never falls back to made-up scales"):
        calibrate(relu_model(), None, progress=False)
    first = calibrate(relu_model(), batches(x, 25), method="minmax", cache=path, device="cpu", progress=False)
    assert path.read_text().startswith("TRT-8601-MinMaxCalibration\n")
    again = calibrate(relu_model(), None, method="minmax", cache=path, progress=False)  # no data: the cache
    assert again.scales == first.scales
    with pytest.raises(ConfigError, match="made with minmax calibration, not entropy"):
        calibrate(relu_model(), None, method="entropy", cache=path, progress=False)
    with pytest.warns(UserWarning, match="calibrating again"):
        redone = calibrate(relu_model(), batches(x, 25), method="entropy", cache=path, device="cpu", progress=False)
    assert Calibration.load(path).method == "entropy" and Calibration.load(path).scales == redone.scales


def test_missing_for_an_engine():
    import kiln

    x = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    engine = kiln.build(relu_model(), kiln.BuildConfig(shapes={"x": (4, 4)}, device="cpu", progress=False))
    cal = calibrate(engine, batches(x, 4), method="minmax", progress=False)
    assert cal.missing_for(engine) == []
    partial = _cal(x=1.0)
    assert partial.missing_for(engine) == ["y"]


def test_values_whose_squares_overflow_fp32_still_save(tmp_path):
    """An additive attention mask holds float32's lowest value: its square overflows FP32, not the FP64 sums."""
    x = np.random.default_rng(1).standard_normal((40, 4)).astype(np.float32)
    x[::7, 0] = np.finfo(np.float32).min
    cal = calibrate(relu_model(), batches(x, 10), method="max", device="cpu", progress=False)
    assert all(np.isfinite(s.sumsq) for s in cal.tensors.values())
    cal.save(tmp_path / "cal.json")  # JSON refuses inf
    assert Calibration.load(tmp_path / "cal.json").amax == cal.amax
