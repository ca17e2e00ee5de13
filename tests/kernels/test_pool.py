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


@pytest.mark.parametrize("shape", [(2, 5, 7, 7), (1, 130, 3, 5)])  # HW and C not multiples of the blocks
@pytest.mark.parametrize("channels_last", [True, False])
def test_spatial_mean_matches_the_reference(shape, channels_last):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    real = torch.empty
    try:  # poison the output the kernel allocates: any unwritten element stays NaN
        torch.empty = lambda *a, **kw: real(*a, **kw).fill_(float("nan"))
        y = pool.spatial_mean(x, block_hw=8, block_c=64)
    finally:
        torch.empty = real
    torch.testing.assert_close(y, x.mean(dim=(2, 3), keepdim=True), atol=1e-5, rtol=1e-5)


def test_spatial_mean_tactic_takes_global_average_pool_and_mean_over_hw_only():
    from kiln.ops.nn import global_average_pool
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    x = torch.randn(2, 6, 5, 3).to(DEV).half()
    axes = torch.tensor([-1, -2])
    gap = Node("GlobalAveragePool", ["x"], ["y"], {})
    mean = Node("ReduceMean", ["x", "axes"], ["y"], {}, opset=18)
    for node, args in ((gap, [x]), (mean, [x, axes])):
        tactic = next(t for t in _TACTICS[("", node.op_type)] if t.name == "triton_spatial_mean")
        assert tactic.applies(node, args) == x.is_cuda  # CPU tensors are refused
        torch.testing.assert_close(tactic.fn(node, *args), global_average_pool(gap, x), atol=1e-3, rtol=1e-3)
    tactic = next(t for t in _TACTICS[("", "ReduceMean")] if t.name == "triton_spatial_mean")
    flat = Node("ReduceMean", ["x", "axes"], ["y"], {"keepdims": 0}, opset=18)
    assert not tactic.applies(flat, [x, axes]) and not tactic.applies(mean, [x, torch.tensor([1, 2])])
