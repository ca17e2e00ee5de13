"""Stem patches in one pass (kernels/stem_patches.py) against the reference, float and 8-bit."""

import os

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import stem_patches
from kiln.ops.fused import quantize_as, stem_patches_reference

from .util import poisoned

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _node(first, columns, width):
    return Node("StemPatches", ["x"], ["y"], {"channels": 4, "first": first, "columns": columns, "width": width},
                domain="kiln")


@pytest.mark.parametrize("geometry", [(-2, 4, 9), (-1, 2, 5), (0, 3, 4)])  # 7x7 pad 3, 3x3 pad 1, 5x5 pad 0
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
# FP8 on the GPU only: Triton 3.8's interpreter drops the mantissa carry when it rounds to FP8 (15.9 -> 8).
@pytest.mark.parametrize("qtype", ["", "int8", pytest.param("fp8", marks=pytest.mark.skipif(
    INTERPRETED, reason="the interpreter rounds values just under a power of two to FP8 one binade low"))])
def test_stem_patches_match_the_reference(geometry, layout, qtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 18, 20 if layout == "strided" else 10, generator=g) * 3
    x = x[..., ::2] if layout == "strided" else x  # every other column of a wider image
    x = (x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x).to(DEV)
    node = _node(*geometry)
    scale = torch.tensor(2.0 ** -4 if qtype == "int8" else 2.0 ** -6, device=DEV)  # powers of two: exact quotients
    assert stem_patches.supports(node, x)
    got = poisoned(lambda: stem_patches.stem_patches(node, x, scale if qtype else None, qtype, block_p=16))
    want = stem_patches_reference(x, 4, *geometry)
    if qtype:
        want = quantize_as(qtype, want, scale)
    assert got.is_contiguous(memory_format=torch.channels_last) and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)


def test_odd_images_are_not_taken():
    assert not stem_patches.supports(_node(-2, 4, 5), torch.zeros(1, 3, 9, 10))
