"""Calibrators against hand-computed values, NVIDIA's reference entropy search, and each other."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from kiln.errors import ConfigError
from kiln.quant import calibrators as C

from . import digits, digits_engine


def _reference_entropy_amax(hist, hist_max, nbins=128, start=128):
    """A literal port of pytorch-quantization's `_compute_amax_entropy` (TensorRT's EntropyCalibration2)."""
    bins = np.array(hist, dtype=np.float64)
    bins[0] = bins[1]
    total = bins.sum()
    divergences, arguments = [], []
    for i in range(start, len(bins) + 1):
        new_counts = np.zeros(nbins)
        space = np.linspace(0, i, num=nbins + 1)
        digitized = np.digitize(range(i), space) - 1
        digitized[bins[:i] == 0] = -1
        for idx, d in enumerate(digitized):
            if d != -1:
                new_counts[d] += bins[idx]
        for key, val in Counter(digitized).items():
            if key != -1:
                new_counts[key] /= val
        new_density = np.zeros(i)
        for idx, d in enumerate(digitized):
            if d != -1:
                new_density[idx] = new_counts[d]
        assert round(new_density.sum() + bins[i:].sum()) == total
        ref = np.array(bins[:i])
        ref[-1] += bins[i:].sum()
        p, q = ref / ref.sum(), new_density / new_density.sum()
        m = p > 0
        kl = math.inf if (q[m] == 0).any() else float(np.sum(p[m] * np.log(p[m] / q[m])))
        divergences.append(kl)
        arguments.append(i)
    d = np.array(divergences)
    last = len(d) - 1 - int(np.argmin(d[::-1]))
    return hist_max * arguments[last] / len(bins), d


def test_scales_by_hand():
    assert C.int8_scale(127.0) == 1.0
    assert C.int8_scale(2.54) == pytest.approx(0.02)
    assert C.fp8_e4m3_scale(448.0) == 1.0
    assert C.fp8_e4m3_scale(4.48) == pytest.approx(0.01)
    assert C.int8_scale(0.0) > 0 and C.fp8_e4m3_scale(0.0) > 0  # a dead tensor never gets a zero scale
    assert C.int8_scale(1.0) == float(np.float32(1 / 127))


def test_percentile_by_hand():
    hist = np.ones(10)  # |x| uniform over [0, 10]: one value per unit bin
    assert C.percentile_amax(hist, 10.0, 50) == 5.0
    assert C.percentile_amax(hist, 10.0, 50.01) == 6.0
    assert C.percentile_amax(hist, 10.0, 100) == 10.0
    assert C.percentile_amax([0, 0, 7, 0], 4.0, 99.99) == 3.0
    with pytest.raises(ConfigError, match="percentile"):
        C.PercentileCalibrator(0)
    with pytest.raises(ConfigError, match="percentile"):
        C.percentile_amax(hist, 10.0, 100.5)


def test_percentile_on_a_known_distribution():
    rng = np.random.default_rng(0)
    a = np.abs(rng.laplace(size=1_000_000))  # |x| ~ Exp(1): the p-quantile is -ln(1 - p)
    hist, _ = np.histogram(a, C.DEFAULT_BINS, (0, a.max()))
    width = a.max() / C.DEFAULT_BINS
    assert C.percentile_amax(hist, a.max(), 99) == pytest.approx(math.log(100), abs=0.03)
    for p in (99.0, 99.9, 99.99):
        got = C.PercentileCalibrator(p).amax(a.max(), hist, a.max())
        assert abs(got - np.percentile(a, p)) <= width  # to one histogram bin of the exact quantile


def test_entropy_search_by_hand():
    # bins[0] takes bins[1] -> [2, 2, 0, 1]; 2 levels. i=2: P=[.4,.6], Q=[.5,.5]; i=3: the last kept bin is
    # empty in Q but holds the outliers in P -> inf; i=4: Q == P -> 0, so the whole range wins.
    amax, cands, kl = C.entropy_search([4, 2, 0, 1], 4.0, num_quant_bins=2, start_bin=2)
    assert list(cands) == [2, 3, 4]
    assert kl[0] == pytest.approx(0.4 * math.log(0.8) + 0.6 * math.log(1.2))
    assert kl[1] == math.inf and kl[2] == pytest.approx(0.0, abs=1e-15)
    assert amax == 4.0


def test_entropy_keeps_the_range_when_every_value_is_in_the_first_bin():
    # The search drops bin 0 (it takes bin 1's count); with all values there nothing is left to divide by.
    hist = np.zeros(2048)
    hist[0] = 1000
    with np.errstate(all="raise"):  # no division by zero on the way
        assert C.entropy_amax(hist, 3.0) == 3.0


@pytest.mark.parametrize("dist", ["normal", "laplace", "student", "relu-lognormal"])
def test_entropy_matches_nvidia_reference(dist):
    rng = np.random.default_rng(1)
    x = {"normal": lambda: rng.standard_normal(20000),
         "laplace": lambda: rng.laplace(size=20000),
         "student": lambda: rng.standard_t(2, size=5000),
         "relu-lognormal": lambda: np.maximum(
             rng.standard_normal(20000) * np.exp(rng.standard_normal(20000)), 0)}[dist]()
    a = np.abs(x)
    hist, _ = np.histogram(a, 512, (0, a.max()))
    want, want_kl = _reference_entropy_amax(hist, a.max())
    got, _, kl = C.entropy_search(hist, a.max())
    assert got == pytest.approx(want, rel=1e-12)
    finite = np.isfinite(want_kl)
    assert (np.isfinite(kl) == finite).all()
    np.testing.assert_allclose(kl[finite], want_kl[finite], rtol=1e-9, atol=1e-12)


def test_entropy_never_clips_the_bulk_of_a_distribution_away_from_zero():
    # Globally pooled ReLU features: every value in a narrow band far from zero. NVIDIA's search finds a near-zero
    # KL at the first bin holding any value (the outliers folded into P's last bin say nothing of how far they lay)
    # and clips nearly everything to it; the calibrator clips at most MAX_CLIPPED of the values.
    rng = np.random.default_rng(3)
    pooled = 0.8 + 0.14 * rng.standard_normal(100_000)
    hist, _ = np.histogram(pooled, C.DEFAULT_BINS, (0, pooled.max()))
    unguarded, _, _ = C.entropy_search(hist, pooled.max())
    assert np.mean(pooled > unguarded) > 0.99
    amax = C.EntropyCalibrator().amax(pooled.max(), hist, pooled.max())
    assert np.mean(pooled > amax) <= C.MAX_CLIPPED
    assert C.entropy_amax(hist, pooled.max()) == amax


def test_calibrators_against_each_other():
    rng = np.random.default_rng(2)
    heavy = np.abs(rng.standard_t(3, size=200_000))  # heavy tail: a few huge values
    hist, _ = np.histogram(heavy, C.DEFAULT_BINS, (0, heavy.max()))
    top = heavy.max()
    mm = C.MinMaxCalibrator().amax(top)
    ent = C.EntropyCalibrator().amax(top, hist, top)
    pct = C.PercentileCalibrator(99.99).amax(top, hist, top)
    assert mm == top
    assert ent < 0.5 * mm  # entropy clips the tail rather than waste levels on it
    assert pct < mm
    assert ent > np.percentile(heavy, 99)  # ...but keeps the bulk

    flat = rng.uniform(0, 1, 200_000)  # no tail: nothing worth clipping
    hist, _ = np.histogram(flat, C.DEFAULT_BINS, (0, flat.max()))
    assert C.EntropyCalibrator().amax(flat.max(), hist, flat.max()) >= 0.95 * flat.max()


def test_get_calibrator():
    assert C.get_calibrator("entropy").trt_name == "EntropyCalibration2"
    assert C.get_calibrator("MinMax").name == "minmax"
    assert C.get_calibrator("percentile", 99.9).percentile == 99.9
    with pytest.raises(ConfigError, match="entropy, minmax, percentile"):
        C.get_calibrator("mse")


def test_per_channel_weight_scales_by_hand():
    w = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    np.testing.assert_array_equal(C.per_channel_amax(w, 0), [3.0, 2.0])
    np.testing.assert_array_equal(C.per_channel_amax(w, 1), [2.0, 3.0])
    ws = C.WeightScale("w", 0, C.per_channel_amax(w, 0))
    np.testing.assert_allclose(ws.scales, [3 / 127, 2 / 127], rtol=1e-7)
    np.testing.assert_allclose(ws.fp8_scales, [3 / 448, 2 / 448], rtol=1e-7)


def test_weight_scales_of_the_digits_engine():
    engine = digits_engine()
    ws = C.weight_scales(engine.graph)
    net = digits().module
    conv1 = net.conv1.weight.detach().numpy()
    fc = net.fc.weight.detach().numpy()  # [10, 512]; the engine stores it [512, 10] (FusedGemm)
    assert ws["conv1.weight"].axis == 0
    np.testing.assert_array_equal(ws["conv1.weight"].amax, np.abs(conv1).reshape(16, -1).max(1))
    assert ws["conv2.weight"].amax.shape == (32,)
    fc_name = next(k for k in ws if k.startswith("fc."))
    assert ws[fc_name].axis == 1
    np.testing.assert_array_equal(ws[fc_name].amax, np.abs(fc).max(1))  # one scale per output class
