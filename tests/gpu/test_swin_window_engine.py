"""A Swin block pair (window, shifted window) as an FP16 engine on the GPU: the window attention on 5-D views and the
row gathers of its rolls and window partitions run in one CUDA graph and match PyTorch."""

import pytest
import torch

import kiln

from ..passes.swin_block import exported

pytestmark = pytest.mark.gpu


def test_swin_blocks_fp16_engine_replays_one_graph_and_matches_torch():
    module, x, onnx_model = exported()
    shape = tuple(x.shape)
    engine = kiln.build(onnx_model, kiln.BuildConfig(profiles=[kiln.Profile({"x": (shape, shape, shape)})],
                                                     device="cuda", fp16=True, progress=False))
    layers = engine.graph.nodes
    attention = [n for n in layers if n.op_type == "Attention"]
    gathers = [n for n in layers if n.op_type == "Gather" and n.placement == "device"]
    assert len(attention) == 2 and len(gathers) == 4, [(n.op_type, n.tactic) for n in attention + gathers]
    assert "Softmax" not in {n.op_type for n in layers}
    ctx = engine.create_execution_context()
    for seed in (1, 2):  # the second run replays the captured graph, index uploads included
        xs = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        got = next(iter(ctx.run({"x": xs.cuda()}).values())).float().cpu()
        with torch.no_grad():
            want = module(xs)
        rel = float((got - want).norm() / want.norm())
        assert rel < 3e-3, (rel, [(n.name[:40], n.tactic) for n in attention])
    assert ctx.uses_cuda_graphs and not ctx.capture_failures, ctx.capture_failures
