"""INT4 weight-only quantization: packing, group-wise rounding, the AWQ search, Int4Linear on digits."""

import pytest
import torch

from kiln.errors import ConfigError
from kiln.examples import digits
from kiln.quant import int4


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_pack_two_codes_per_byte_round_trip():
    u = torch.randint(0, 16, (7, 5), generator=torch.Generator().manual_seed(0))
    p = int4.pack_int4(u)
    assert p.dtype == torch.uint8 and p.shape == (4, 5)
    assert p[0, 0] == u[0, 0] | (u[1, 0] << 4)
    assert torch.equal(int4.unpack_int4(p, 7), u.to(torch.int16))
    with pytest.raises(ConfigError):
        int4.pack_int4(u - 8)


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_group_wise_rounding_is_within_half_a_step(group_size, symmetric):
    w = _rand(200, 24, seed=group_size) + (0.0 if symmetric else 0.7)  # K not a multiple of any group
    q = int4.quantize_weight(w, group_size, symmetric)
    assert q.scales.shape == (-(-200 // group_size), 24) and q.packed.shape == (100, 24)
    assert (q.zeros is None) == symmetric
    err = (q.dequantize() - w).abs()
    step = q.scales.repeat_interleave(group_size, 0)[:200]
    assert bool((err <= step / 2 + 1e-6).all())
    torch.testing.assert_close(q.dequantize(), int4.fake_quantize(w, group_size, symmetric))
    if not symmetric:  # asymmetric uses all 16 codes on a shifted range: smaller error there
        assert err.mean() < (int4.quantize_weight(w, group_size, True).dequantize() - w).abs().mean()
    assert q.nbytes <= w.numel() * 6 / 8  # at most 6 bits a weight here (4 + FP32 scales and zeros at group 32)


def test_awq_search_reduces_the_output_error_with_outlier_channels():
    K, N = 256, 64
    w = _rand(K, N, seed=1) * 0.05
    x = _rand(512, K, seed=2)
    x[:, ::16] *= 25.0  # a few salient input channels, as in LLM activations
    found = int4.awq_search(w, x, group_size=64)
    print(found)
    assert 0.0 < found.alpha <= 1.0 and found.errors[0.0] == found.plain_error
    assert found.error == min(found.errors.values()) and found.error_reduction > 0.2
    q, again = int4.quantize_awq(w, x, group_size=64)
    assert again.alpha == found.alpha and q.in_scale is not None
    rel = float((q.matmul(x) - x @ w).norm() / (x @ w).norm())
    assert rel == pytest.approx(found.error, rel=1e-4)
    # The Triton kernel (interpreted without a GPU) computes the same product, in_scale included.
    xs = x[:5]
    torch.testing.assert_close(q.matmul(xs, kernel=True), q.matmul(xs, kernel=False), atol=1e-4, rtol=1e-4)


def test_awq_picks_plain_rounding_when_nothing_helps():
    w, x = _rand(64, 8, seed=3), _rand(100, 64, seed=4)
    x[:] = 1.0  # every channel alike: s is all ones for every alpha
    found = int4.awq_search(w, x, group_size=32, grid=4)
    assert found.alpha == 0.0 and found.error_reduction == 0.0
    with pytest.raises(ConfigError):
        int4.awq_search(w, _rand(10, 63), group_size=32)


def test_int4_linear_on_the_digits_cnn():
    split = digits.load_split(0)
    x_tr, _, x_te, y_te = split
    net = digits.train(0, epochs=10, split=split)
    fp32 = digits.accuracy(net, x_te, y_te)
    ref = net.fc.weight.detach().clone()
    report = int4.quantize_module(net, torch.from_numpy(x_tr[:256]), group_size=32)
    assert isinstance(net.fc, int4.Int4Linear) and set(report) == {"fc"}
    acc = digits.accuracy(net, x_te, y_te)
    print(f"digits fc INT4 g32 weight-only: {acc:.2f}% vs FP32 {fp32:.2f}%; {report['fc']}")
    assert acc >= fp32 - 1.0
    assert net.fc.packed.numel() == ref.numel() // 2
    with pytest.raises(ConfigError):
        int4.quantize_module(net, group_size=48)
