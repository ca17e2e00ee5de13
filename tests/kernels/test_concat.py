"""kernels/concat.py: channels-last concat along channels against torch.cat (Triton's interpreter on the CPU)."""

import pytest
import torch

from kiln.kernels import concat

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cl(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV).to(memory_format=torch.channels_last)


def test_a_c2f_block_split_halves_and_bottleneck_outputs():
    """The split's halves are channel slices of one map (pixel stride 2C); 70 pixels: a partial last block."""
    split = _cl(2, 12, 5, 7)
    xs = [split[:, :6], split[:, 6:], _cl(2, 6, 5, 7, seed=1)]
    assert concat.supports(xs) and concat.pixel_stride(xs[0]) == 12
    y = poisoned(lambda: concat.concat_channels(xs))
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, torch.cat(xs, 1), atol=0, rtol=0)


def test_more_inputs_than_a_launch_takes_and_wide_channels():
    xs = [_cl(1, c, 3, 3, seed=c) for c in (3, 130, 1, 5, 8, 2)]  # 130 channels: two channel blocks
    y = poisoned(lambda: concat.concat_channels(xs))
    torch.testing.assert_close(y, torch.cat(xs, 1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_size_one_pixels_axes(dtype):
    """A pooled [N, C, 1, 1] map (its strides on the size-1 axes are anything) beside a contiguous one."""
    a = torch.randn(4, 6, 1, 1).to(DEV, dtype)
    b = torch.randn(4, 3, 1, 1).to(DEV, dtype).to(memory_format=torch.channels_last)
    assert concat.supports([a, b])
    torch.testing.assert_close(concat.concat_channels([a, b]), torch.cat([a, b], 1), atol=0, rtol=0)


def test_what_it_takes():
    nchw = torch.randn(2, 4, 3, 3)  # NCHW: channels not contiguous
    assert not concat.supports([nchw, nchw])
    a = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    assert not concat.supports([a, a[:, :, :2]])  # other H
    assert not concat.supports([a, a.half()])
    assert not concat.supports([a])


def test_the_tactic_takes_the_channel_axis_of_gpu_images():
    from kiln.ir.graph import Node
    from kiln.tactics import candidates, load_all
    from kiln.tactics.triton_tactics import (
        _concat_channels_ok,
        triton_concat_channels_last,
    )

    load_all()
    assert "triton_concat_channels_last" in {t.name for t in candidates(Node("Concat", [], [], {}))}
    xs = [_cl(2, 3, 4, 4), _cl(2, 5, 4, 4, seed=1)]
    for axis, want in ((1, DEV == "cuda"), (-3, DEV == "cuda"), (2, False)):
        node = Node("Concat", ["a", "b"], ["y"], {"axis": axis})
        assert _concat_channels_ok(node, xs) == want
    node = Node("Concat", ["a", "b"], ["y"], {"axis": 1})
    torch.testing.assert_close(triton_concat_channels_last(node, *xs), torch.cat(xs, 1), atol=0, rtol=0)
