"""Hand tests for norm.py: opset differences, stash types, FP16 builds and restrictions."""

import numpy as np
import pytest
import torch

from kiln.errors import UnsupportedError

from .util import run_kiln as _kiln
from .util import run_ort as _ort
from .util import single_op_model as _model

rng = np.random.default_rng(0)


def _randn(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def test_group_norm_opset18_scale_per_group():
    x, scale, bias = _randn(2, 6, 3, 3), _randn(3), _randn(3)
    feeds = {"x": x, "scale": scale, "bias": bias}
    (y,) = _kiln(_model("GroupNormalization", feeds, opset=18, num_groups=3, epsilon=1e-3), feeds)
    want = torch.nn.functional.group_norm(torch.from_numpy(x), 3, eps=1e-3).numpy()
    want = want * np.repeat(scale, 2)[None, :, None, None] + np.repeat(bias, 2)[None, :, None, None]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_group_norm_opset21_matches_onnxruntime():
    feeds = {"x": _randn(2, 6, 5), "scale": _randn(6), "bias": _randn(6)}
    model = _model("GroupNormalization", feeds, opset=21, num_groups=2)
    np.testing.assert_allclose(_kiln(model, feeds)[0], _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_layer_norm_broadcast_scale_and_stats_fp16():
    # Scale broadcasts over the normalized shape; in an FP16 build Mean/InvStdDev stay in the stash type.
    x, scale, bias = _randn(3, 4, 5, scale=30.0), _randn(1, 5), _randn(5)
    feeds = {"x": x, "scale": scale, "bias": bias}
    model = _model("LayerNormalization", feeds, outs=("y", "mean", "inv_std"), opset=17, axis=1)
    want = _ort(model, feeds)
    got = _kiln(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    y, mean, inv_std = _kiln(model, feeds, fp16=True)
    assert mean.dtype == inv_std.dtype == np.float32
    np.testing.assert_allclose(y.astype(np.float32), want[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(inv_std, want[2], rtol=1e-3)


def test_rms_norm_fp16_large_values():
    # x**2 = 90000 overflows FP16: the statistics are computed in the stash type (FP32).
    x, scale = _randn(2, 8, scale=300.0), _randn(8)
    feeds = {"x": x, "scale": scale}
    (y,) = _kiln(_model("RMSNormalization", feeds, opset=23), feeds, fp16=True)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_instance_norm_fp16_build():
    feeds = {"x": _randn(2, 3, 4, 5, scale=10.0), "scale": _randn(3), "b": _randn(3)}
    model = _model("InstanceNormalization", feeds)
    (want,) = _ort(model, feeds)
    (y,) = _kiln(model, feeds, fp16=True)
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_mean_variance_norm_custom_axes():
    feeds = {"x": _randn(2, 3, 4, 5)}
    model = _model("MeanVarianceNormalization", feeds, opset=13, axes=[1, 3])
    np.testing.assert_allclose(_kiln(model, feeds)[0], _ort(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_lp_norm_zero_slice_is_zero():
    x = np.array([[0.0, 0.0, 0.0], [3.0, -4.0, 0.0]], dtype=np.float32)
    (y,) = _kiln(_model("LpNormalization", {"x": x}, axis=1, p=2), {"x": x})
    np.testing.assert_allclose(y, [[0, 0, 0], [0.6, -0.8, 0]], rtol=1e-6)


def test_batch_norm_restrictions_are_reported():
    x, p = _randn(2, 3, 4), _randn(3)
    feeds = {"x": x, "s": p, "b": p, "m": p, "v": np.abs(p)}
    with pytest.raises(UnsupportedError, match="batchnormalization_under_test.*spatial=0"):
        _kiln(_model("BatchNormalization", feeds, opset=7, spatial=0), feeds)
    outs = ("y", "mean", "var", "saved_mean", "saved_var")
    with pytest.raises(UnsupportedError, match="batchnormalization_under_test.*training-mode"):
        _kiln(_model("BatchNormalization", feeds, outs=outs, opset=9), feeds)
