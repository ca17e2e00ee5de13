import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import pool
from kiln.ops.nn import max_pool

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape, attrs", [
    ((2, 5, 9, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # ResNet's stem pool
    ((1, 70, 6, 5), {"kernel_shape": [2, 3], "strides": [1, 2], "ceil_mode": 1}),  # C over one block, ceil mode
    ((1, 3, 8, 8), {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [2, 2]}),
])
@pytest.mark.parametrize("channels_last", [True, False])
def test_max_pool_matches_the_reference(shape, attrs, channels_last):
    node = Node("MaxPool", ["x"], ["y"], attrs)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEV)
    x.view(-1)[3] = float("nan")  # NaN propagates, as in torch
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    want = max_pool(node, x)
    poisoned = torch.full((shape[0], want.shape[2], want.shape[3], shape[1]), 12345.0, device=DEV)
    orig = torch.empty
    try:  # every output element must be written: the kernel's buffer starts as 12345
        torch.empty = lambda *a, **kw: poisoned
        got = pool.max_pool2d(node, x)
    finally:
        torch.empty = orig
    torch.testing.assert_close(got, want, equal_nan=True)

