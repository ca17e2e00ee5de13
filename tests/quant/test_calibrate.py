"""Calibration on real engines: statistics, data sources, sample counts, bad input."""

import warnings

import numpy as np
import pytest
import torch

import kiln
from kiln.errors import ConfigError, InputError, ShapeError
from kiln.quant import CalibrationWarning, calibrate

from . import CPU, batches, digits, digits_engine, relu_model


def _calib_images():
    with np.load(digits().calib_path) as z:
        return z["image"]


def test_minmax_ranges_are_exact_on_a_relu():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, 4)).astype(np.float32) * np.array([1, 2, 3, 4], np.float32)
    cal = calibrate(relu_model(), batches(x, 16), method="minmax", device="cpu", progress=False)
    assert cal.samples == 120 and cal.method == "minmax"
    assert set(cal.tensors) == {"x", "y"}
    sx, sy = cal.tensors["x"], cal.tensors["y"]
    assert (sx.min, sx.max) == (float(x.min()), float(x.max()))
    assert sx.amax == float(np.abs(x).max())
    assert (sy.min, sy.max, sy.amax) == (0.0, float(x.max()), float(x.max()))
    assert sy.zero_fraction == pytest.approx(float((x <= 0).mean()))
    assert sx.mean == pytest.approx(float(x.mean()), abs=1e-6) and sx.std == pytest.approx(float(x.std()), rel=1e-5)
    assert cal.scales["x"] == float(np.float32(np.abs(x).max() / 127))
    assert cal.fp8_scales["y"] == float(np.float32(x.max() / 448))
    assert cal.engine["precision"] == "float32" and cal.engine["device"] == "cpu"


def test_digits_ranges_match_pytorch_and_methods_order():
    d = digits()
    x = _calib_images()
    net = d.module
    with torch.inference_mode():
        relu1 = torch.relu(net.conv1(torch.from_numpy(x)))
        logits = net(torch.from_numpy(x))
    cals = {m: calibrate(d.onnx_path, d.calib_path, method=m, device="cpu", progress=False)
            for m in ("minmax", "percentile", "entropy")}
    mm = cals["minmax"]
    assert mm.samples == 256
    engine = digits_engine()
    produced = {"image"} | {o for n in engine.graph.nodes if n.placement == "device" for o in n.outputs}
    assert set(mm.tensors) == produced  # the engine's tensors, named after fusion (relu1, not conv1)
    assert mm.tensors["relu1"].max == pytest.approx(float(relu1.max()), rel=1e-5)
    assert mm.tensors["logits"].absmax == pytest.approx(float(logits.abs().max()), rel=1e-5)
    assert mm.tensors["image"].max == float(x.max())
    for name in mm.tensors:
        assert cals["entropy"].amax[name] <= mm.amax[name]
        assert cals["percentile"].amax[name] <= mm.amax[name]
        assert cals["entropy"].tensors[name].hist.sum() == mm.tensors[name].count
    assert cals["percentile"].percentile == 99.99
    assert sum(cals["entropy"].amax[n] < mm.amax[n] for n in mm.tensors) >= 2  # entropy does clip some tails
    assert set(mm.weights) == {"conv1.weight", "conv2.weight", "fc.weight_kn"}
    assert "relu1" in mm.render() and mm.histograms()[0]["name"] == "image"


def test_an_engine_and_every_data_source_agree(tmp_path):
    d = digits()
    x = _calib_images()
    base = calibrate(d.onnx_path, d.calib_path, method="minmax", device="cpu", progress=False)
    engine = digits_engine(hi=64)  # 256 rows arrive as one .npz: cut into batches of 64
    np.save(tmp_path / "image.npy", x)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(0, 256, 32):
        np.savez(folder / f"{i:04d}.npz", image=x[i:i + 32])
    sources = [d.calib_path, str(tmp_path / "image.npy"), f"image:{tmp_path / 'image.npy'}", folder,
               batches(x, 50, "image"), ({"image": torch.from_numpy(x[i:i + 8])} for i in range(0, 256, 8))]
    for src in sources:
        cal = calibrate(engine, src, method="minmax", progress=False)
        assert cal.samples == 256
        assert cal.amax == base.amax
        assert {k: (s.min, s.max, s.count) for k, s in cal.tensors.items()} == \
               {k: (s.min, s.max, s.count) for k, s in base.tensors.items()}


def test_too_few_samples_warn():
    x = np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32)
    with pytest.warns(CalibrationWarning, match="only 20 samples.*100 to 1000"):
        cal = calibrate(relu_model(), {"x": x}, method="minmax", device="cpu", progress=False)
    assert cal.samples == 20
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        calibrate(relu_model(), {"x": np.tile(x, (5, 1))}, method="minmax", device="cpu", progress=False)


def test_progress_lines_off_a_terminal(capsys):
    x = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    calibrate(relu_model(), batches(x, 25), method="entropy", device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "kiln calibrate" in err and "pass 1/2: ranges" in err and "pass 2/2: histograms" in err


def test_bad_data_is_refused_naming_the_input():
    x = _calib_images()
    engine = digits_engine(lo=4, hi=64)
    run = lambda data, **kw: calibrate(engine, data, progress=False, **kw)
    with pytest.raises(InputError, match=r"input 'image' is float64 but the model expects float32.*astype"):
        run({"image": x.astype(np.float64)})
    with pytest.raises(ShapeError, match=r"input 'image' has rank 3"):
        run({"image": x[:, 0]})
    with pytest.raises(ShapeError, match=r"input 'image' axis 2 is 16, but the model fixes it at 8"):
        run({"image": np.zeros((8, 1, 16, 16), np.float32)})
    with pytest.raises(ShapeError,
                       match=r"input 'image' axis 0 is 2, outside optimization profile 0's range \[4, 64\]"):
        run([{"image": x[:8]}, {"image": x[:2]}])
    with pytest.raises(InputError,
                       match=r"item 1: \['img'\] are not inputs of the model and inputs \['image'\] are missing"):
        run([{"image": x[:8]}, {"img": x[:8]}])
    bad = x[:8].copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(InputError, match="input 'image' contains NaN"):
        run({"image": bad})
    with pytest.raises(InputError, match="item 0 is a ndarray"):
        run([x[:8]])
    with pytest.raises(InputError, match="does not exist"):
        run("/nonexistent/calib.npz")
    with pytest.raises(InputError, match="no samples"):
        run([])
    with pytest.raises(ConfigError, match="unknown calibration method 'kl-mse'"):
        run({"image": x}, method="kl-mse")


def test_reduced_precision_engines_are_refused():
    fp16 = kiln.build(relu_model(), kiln.BuildConfig(fp16=True, shapes={"x": (8, 4)}, **CPU))
    with pytest.raises(ConfigError, match="needs an FP32 engine.*float16"):
        calibrate(fp16, {"x": np.zeros((8, 4), np.float32)}, progress=False)
    # A build config asking for FP16 is calibrated on its FP32 twin (same profile and target).
    cfg = kiln.BuildConfig(fp16=True, profiles=[kiln.Profile({"x": ((1, 4), (8, 4), (8, 4))})], **CPU)
    with pytest.warns(CalibrationWarning):
        cal = calibrate(relu_model(), batches(np.ones((16, 4), np.float32), 8), build_config=cfg, progress=False)
    assert cal.engine["precision"] == "float32" and cal.amax["y"] == 1.0
