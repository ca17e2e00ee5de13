"""tactics/resize.py: the one-pass Resize/Upsample tactics against the op's reference (ops/image.py) wherever
they are offered, and not offered where they would differ."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.ops.image import resize, upsample
from kiln.tactics.resize import (
    _linear_plan,
    _nearest_factors,
    torch_interpolate_linear,
    torch_upsample_nearest,
)

E = torch.tensor([])


def _node(mode, ctm, nearest="round_prefer_floor", opset=17):
    return Node("Resize", ["x", "roi", "scales", "sizes"], ["y"],
                {"mode": mode, "coordinate_transformation_mode": ctm, "nearest_mode": nearest}, opset=opset)


def _image(channels_last, shape=(2, 6, 5, 7)):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return x.to(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("ctm, nearest", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                                          ("pytorch_half_pixel", "round_prefer_ceil"),
                                          ("asymmetric", "round_prefer_floor")])
@pytest.mark.parametrize("channels_last", [False, True])
def test_nearest_integer_factors_repeat_each_pixel(ctm, nearest, channels_last):
    x, node = _image(channels_last), _node("nearest", ctm, nearest)
    scales = torch.tensor([1.0, 1.0, 2.0, 2.0])
    assert _nearest_factors(node, [x, E, scales, E]) == (2, 2)
    y = torch_upsample_nearest(node, x, E, scales, E)
    torch.testing.assert_close(y, resize(node, x, E, scales, E), atol=0, rtol=0)
    # the next convolution reads it in the layout it came in
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    sizes = torch.tensor([2, 6, 15, 7])  # by sizes: 3x along H, 1x along W
    if _nearest_factors(node, [x, E, E, sizes]) is not None:
        torch.testing.assert_close(torch_upsample_nearest(node, x, E, E, sizes), resize(node, x, E, E, sizes))


def test_upsample_9_nearest():
    x = _image(True)
    node = Node("Upsample", ["x", "scales"], ["y"], {"mode": "nearest"}, opset=9)
    scales = torch.tensor([1.0, 1.0, 2.0, 3.0])
    torch.testing.assert_close(torch_upsample_nearest(node, x, scales), upsample(node, x, scales), atol=0, rtol=0)


@pytest.mark.parametrize("ctm, nearest, scale", [("asymmetric", "round_prefer_floor", 3.0), ("asymmetric", "ceil", 2.0),
                                                 ("half_pixel", "floor", 2.0), ("align_corners", "floor", 2.0),
                                                 ("tf_crop_and_resize", "floor", 2.0),
                                                 ("asymmetric", "floor", 1.5)])
def test_nearest_left_to_the_reference_where_it_picks_other_pixels(ctm, nearest, scale):
    x = _image(False)
    node = _node("nearest", ctm, nearest)
    assert _nearest_factors(node, [x, E, torch.tensor([1.0, 1.0, scale, scale]), E]) is None


@pytest.mark.parametrize("ctm", ["half_pixel", "pytorch_half_pixel", "align_corners"])
@pytest.mark.parametrize("size", [(8, 8), (4, 6), (10, 14)])  # MobileViT's 7 -> 8 and back; down and up
def test_linear_by_sizes_matches_the_reference(ctm, size):
    x, node = _image(True, (2, 3, 7, 7)), _node("linear", ctm)
    sizes = torch.tensor([2, 3, *size])
    assert _linear_plan(node, [x, E, E, sizes]) is not None
    torch.testing.assert_close(torch_interpolate_linear(node, x, E, E, sizes), resize(node, x, E, E, sizes),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [2.0, 0.5, 1.75])
def test_linear_by_scales_maps_through_the_given_scale(scale):
    x, node = _image(False, (1, 2, 8, 8)), _node("linear", "half_pixel")
    scales = torch.tensor([1.0, 1.0, scale, scale])
    torch.testing.assert_close(torch_interpolate_linear(node, x, E, scales, E), resize(node, x, E, scales, E),
                               atol=1e-5, rtol=1e-5)


def test_linear_left_to_the_reference():
    x = _image(False)
    sizes = torch.tensor([2, 6, 10, 14])
    assert _linear_plan(_node("linear", "asymmetric"), [x, E, E, sizes]) is None
    assert _linear_plan(_node("cubic", "half_pixel"), [x, E, E, sizes]) is None
    assert _linear_plan(_node("linear", "half_pixel"), [x, E, E, torch.tensor([2, 3, 10, 14])]) is None  # channels
    antialiased = _node("linear", "half_pixel")
    antialiased.attrs["antialias"] = 1
    assert _linear_plan(antialiased, [x, E, E, sizes]) is None


@pytest.mark.gpu
def test_offered_on_the_gpu_in_fp16():
    from kiln.tactics.resize import _linear_ok, _nearest_ok

    x = _image(True, (2, 16, 20, 20)).half().cuda()
    up = _node("nearest", "asymmetric", "floor")
    scales = torch.tensor([1.0, 1.0, 2.0, 2.0])
    assert _nearest_ok(up, [x, E, scales, E])
    torch.testing.assert_close(torch_upsample_nearest(up, x, E, scales, E), resize(up, x, E, scales, E), atol=0, rtol=0)
    lin, sizes = _node("linear", "pytorch_half_pixel"), torch.tensor([2, 16, 24, 24])
    assert _linear_ok(lin, [x, E, E, sizes])
    torch.testing.assert_close(torch_interpolate_linear(lin, x, E, E, sizes).float(),
                               resize(lin, x.float(), E, E, sizes), atol=2e-3, rtol=2e-3)
