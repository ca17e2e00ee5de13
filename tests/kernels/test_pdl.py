"""Programmatic dependent launch (kernels/pdl.py): when it is asked for (CPU), and on a Hopper GPU a chain of the
kernels that use it (ws_gemm -> ws_conv -> halo_conv -> ws_gemm with the first's input as residual -> tma_gemm),
captured in a CUDA graph with it and replayed over fresh inputs, equal to the same chain run without it: a kernel
reading before its predecessor has finished would show as a difference."""

import pytest
import torch

from kiln.kernels import halo_conv, pdl, tma_gemm, ws_conv, ws_gemm
from kiln.kernels.conv import pixel_rows
from kiln.kernels.gemm import TileConfig

from .test_ws_conv import HOPPER
from .test_ws_conv import _node as conv_node
from .test_ws_gemm import _node as gemm_node


def test_it_is_asked_for_only_on_a_hopper_gpu_and_unless_the_launcher_is_told_not_to():
    assert pdl.launch_options(torch.device("cpu")) == {}
    if HOPPER:
        assert pdl.launch_options(torch.device("cuda")) == {"launch_pdl": True}
        assert pdl.launch_options(torch.device("cuda"), pdl=False) == {}
    assert not hasattr(pdl, "ENABLED")  # an explicit keyword of each launcher, not a module switch


def _weights(g, oc, c, k):
    w = torch.randint(-20, 21, (oc, c, k, k), generator=g, device="cuda").to(torch.int8)
    return (w.to(memory_format=torch.channels_last), torch.rand(oc, generator=g, device="cuda") * 1e-2 + 1e-3,
            torch.randn(oc, generator=g, device="cuda").half())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (griddepcontrol, wgmma)")
def test_a_chain_launched_with_it_equals_one_launched_without():
    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.tensor(0.05, device="cuda")
    (w1, s1, b1), (w2, s2, b2), (w3, s3, b3) = _weights(g, 64, 256, 1), _weights(g, 64, 64, 3), _weights(g, 256, 64, 1)
    (w4, s4, b4), (w5, s5, b5) = _weights(g, 128, 256, 1), _weights(g, 64, 64, 3)
    one, three = gemm_node(), conv_node()
    c1, c3 = ws_gemm.WsGemmConfig(128, 64, 3, 2), ws_gemm.WsGemmConfig(128, 128, 2, 2)
    c2 = next(c for c, _ in ws_conv.CONFIGS if c.resident_weights)  # waits before loading its filter
    x = torch.empty((8, 256, 28, 28), dtype=torch.int8, device="cuda").to(memory_format=torch.channels_last)

    def chain(pdl=True):
        h = ws_gemm.matmul8(one, x, w1, b1, None, c1, s, s1, s, pdl=pdl)
        h = ws_conv.conv2d(three, h, w2, b2, c2, s, s2, s, pdl=pdl)
        h = halo_conv.conv2d(three, h, w5, b5, s, s5, s, pdl=pdl)
        h = ws_gemm.matmul8(one, h, w3, b3, x, c3, s, s3, s, s, pdl=pdl)
        return tma_gemm.gemm(pixel_rows(h), w4.reshape(128, 256).t(), b4, "Relu",
                             config=TileConfig(128, 128, 128, 4, 3), qtype="int8", x_scale=s, w_scale=s4, y_scale=s,
                             pdl=pdl)

    h = torch.empty((8, 64, 28, 28), dtype=torch.int8, device="cuda").to(memory_format=torch.channels_last)
    assert ws_conv.supports(three, h, w2, b2, None, s, None, c2) and halo_conv.supports(three, h, w5, b5, None, s, None)
    inputs = [torch.randint(-60, 61, x.shape, generator=g, device="cuda").to(torch.int8) for _ in range(8)]
    want = []
    for v in inputs:
        x.copy_(v)
        want.append(chain(pdl=False).clone())
    chain()  # compiles the kernels launched with it outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for v, expected in zip(inputs, want):
        x.copy_(v)
        graph.replay()
        assert torch.equal(out, expected)
