"""The depthwise / squeeze-excite CNN tactics' CPU-checkable parts: which layers are offered them, and that their
functions compute the layer (Triton's interpreter). Timed in real GPU builds in tests/gpu/test_conv_tactics.py."""

import torch

from kiln.ir.graph import Node
from kiln.kernels.depthwise_conv import CONFIGS
from kiln.ops.fused import fused_conv
from kiln.tactics import candidates, load_all
from kiln.tactics.triton_conv import (
    _depthwise_applies,
    _depthwise_run,
    _spatial_mean_run,
)


def _names(op, domain):
    load_all()
    return {t.name for t in candidates(Node(op, [], [], {}, domain=domain)) if t.level <= 3}


def test_offered_at_the_default_level_to_convolutions_and_spatial_means():
    for op, domain in (("FusedConv", "kiln"), ("Conv", "")):
        names = _names(op, domain)
        for prefix in ("triton_depthwise_", "triton_conv_narrow_", "triton_conv1x1_rows_", "cudnn_conv_benchmarked"):
            assert any(n.startswith(prefix) for n in names), (op, prefix)
    for op in ("ReduceMean", "GlobalAveragePool"):
        assert any(n.startswith("triton_spatial_mean_") for n in _names(op, ""))


def test_an_onnx_depthwise_conv_runs_its_bias_through_the_tactic():
    """An ONNX Conv (x, w, b) of group == channels: the tactic's function takes the Conv's own inputs; not offered
    for CPU tensors."""
    node = Node("Conv", ["x", "w", "b"], ["y"], {"group": 12, "pads": [1, 1, 1, 1], "strides": [2, 2]})
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 12, 7, 7, generator=g), torch.randn(12, 1, 3, 3, generator=g), torch.randn(12, generator=g)
    assert not _depthwise_applies(node, [x, w, b])
    torch.testing.assert_close(_depthwise_run(CONFIGS[0])(node, x, w, b), fused_conv(node, x, w, b), atol=1e-4, rtol=1e-4)


def test_reduce_mean_keeps_or_drops_the_reduced_axes():
    from kiln.kernels.pool import MEAN_CONFIGS

    x = torch.randn(2, 20, 5, 6, generator=torch.Generator().manual_seed(1))
    run = _spatial_mean_run(MEAN_CONFIGS[0])
    for keep in (1, 0):
        node = Node("ReduceMean", ["x", "axes"], ["y"], {"keepdims": keep})
        torch.testing.assert_close(run(node, x, torch.tensor([2, 3])), x.mean(dim=(2, 3), keepdim=bool(keep)))
    node = Node("GlobalAveragePool", ["x"], ["y"], {})
    torch.testing.assert_close(run(node, x), x.mean(dim=(2, 3), keepdim=True))
