"""QAT input scales: started from Kiln's post-training calibration, and never from an all-zero batch."""

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ConfigError
from kiln.quant import qat
from kiln.quant.calibrators import get_calibrator


def _heavy_tailed(n=512, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.sinh(2.0 * torch.randn(n, d, generator=g))  # a few large outliers per feature


def _mlp(d=16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_all_zero_or_nonfinite_first_batch_leaves_the_input_scale_unset():
    fq = qat.FakeQuantize(bits=8, signed=None)
    assert torch.equal(fq(torch.zeros(4, 8)), torch.zeros(4, 8))
    assert not bool(fq.initialized)
    fq(torch.tensor([[1.0, float("inf")]]))
    assert not bool(fq.initialized)
    x = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    fq(x)
    assert bool(fq.initialized) and bool(fq.signed)
    torch.testing.assert_close(fq.scale.detach(), torch.tensor(2.0 / 127))


class _RNN(nn.Module):
    """h_t = tanh(W_x x_t + W_h h_{t-1}), h_0 = 0: the recurrent layer's first input is all zeros."""

    def __init__(self, d=8, h=32):
        super().__init__()
        self.inp, self.rec, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 3)

    def forward(self, x):  # x [batch, time, d]
        h = x.new_zeros(x.shape[0], self.rec.in_features)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.out(h)


def test_rnn_recurrent_layer_is_initialized_from_its_first_nonzero_state():
    torch.manual_seed(0)
    net = _RNN()
    x = torch.randn(64, 6, 8)
    with torch.no_grad():
        want = net(x)
    q = qat.prepare(net, bits=8, weight_bits=8)
    with torch.no_grad():
        got = q(x)
    s = float(q.rec.input_quant.scale.detach())
    assert 0.5 / 127 < s <= 1.0 / 127  # max |tanh(.)| of step 1, not the 1e-8 of the zero state
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_prepare_with_calib_sets_input_scales_from_kiln_calibrators():
    x = _heavy_tailed()
    net = _mlp()
    q_old = qat.prepare(_mlp(), bits=8)
    qat.calibrate(q_old, x[:256])
    amax = {}
    for method in ("entropy", "minmax", "percentile"):
        q = qat.prepare(_mlp(), bits=8, calib=[x[:256], x[256:]], calib_method=method, percentile=99.9)
        assert q.training and all(m.enabled for m in q.modules() if isinstance(m, qat.FakeQuantize))
        fq = [q[i].input_quant for i in (0, 2, 4)]
        assert all(bool(f.initialized) for f in fq)
        assert bool(fq[0].signed) and not bool(fq[1].signed) and not bool(fq[2].signed)  # after ReLUs: unsigned
        amax[method] = [float(f.scale.detach()) * f.qrange[1] for f in fq]
    # minmax over both batches is the float max |x| of each layer's input
    with torch.no_grad():
        h = net[1](net[0](x))
        hidden = [x, h, net[3](net[2](h))]
    np.testing.assert_allclose(amax["minmax"], [float(t.abs().max()) for t in hidden], rtol=1e-5)
    # entropy and percentile clip the heavy-tailed network input far below its max
    assert amax["entropy"][0] < 0.5 * amax["minmax"][0]
    assert amax["percentile"][0] < amax["minmax"][0]
    # without calib: max |x| of the first batch, as before
    assert float(q_old[0].input_quant.scale.detach()) * 127 == pytest.approx(float(x[:256].abs().max()), rel=1e-5)


def test_calib_entropy_amax_equals_kiln_ptq_calibration():
    """The network input's amax is exactly what kiln.quant.calibrate picks for the FP32 ONNX model."""
    x = _heavy_tailed(n=320)
    net = _mlp().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    proto, _ = kiln.from_torch(net, (x[:4],), dynamic_shapes=({0: batch},), input_names=["features"])
    cal = kiln.quant.calibrate(proto, [{"features": x.numpy()}], method="entropy", device="cpu", progress=False)
    amax = qat.calibrate_inputs(qat.prepare(_mlp(), bits=8), x, method="entropy")
    assert amax["0"] == pytest.approx(cal.tensors["features"].amax, rel=1e-6)
    # the same calibrator on the histogram of |x| (Kiln's 2048 bins over [0, max |x|])
    a = x.abs().reshape(-1)
    hist = torch.histc(a, bins=2048, min=0, max=float(a.max())).numpy()
    assert amax["0"] == pytest.approx(get_calibrator("entropy").amax(float(a.max()), hist, float(a.max())), rel=1e-6)


def test_calibrate_inputs_rejects_bad_data():
    q = qat.prepare(_mlp(), bits=8)
    with pytest.raises(ConfigError):
        qat.calibrate_inputs(q, [])
    with pytest.raises(ConfigError):
        qat.calibrate_inputs(q, 3.0)
    with pytest.raises(ConfigError, match="no fake-quantized input"):
        qat.calibrate_inputs(qat.prepare(_mlp(), bits=None), _heavy_tailed())
