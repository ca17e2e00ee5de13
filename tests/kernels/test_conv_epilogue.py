"""kernels/conv_epilogue.py: a convolution's bias, residual and activation as one generated pass over its output
(Triton's interpreter on the CPU), against the fused layer's own arithmetic."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv_epilogue
from kiln.ops.fused import fused_conv

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACTIVATIONS = [("", []), ("Relu", []), ("Silu", []), ("HardSwish", []), ("Sigmoid", []), ("GeluErf", []),
               ("GeluTanh", []), ("Tanh", []), ("LeakyRelu", [0.1]), ("Clip", [0.0, 6.0])]


@pytest.mark.parametrize("act, params", ACTIVATIONS, ids=[a or "none" for a, _ in ACTIVATIONS])
@pytest.mark.parametrize("residual", [False, True])
def test_one_pass_matches_the_fused_layer(act, params, residual):
    """A channels-last output written over in place; the residual a channel slice (a strided view, as a C2f
    block's split gives); FP32 so the comparison is exact up to the order of the adds."""
    g = torch.Generator().manual_seed(len(act) + residual)
    node = Node("FusedConv", ["x", "w", "b"] + (["z"] if residual else []), ["y"],
                {"pads": [1, 1, 1, 1], "activation": act, "activation_params": params}, domain="kiln")
    x = torch.randn(2, 5, 6, 7, generator=g).to(DEV).to(memory_format=torch.channels_last)
    w = torch.randn(12, 5, 3, 3, generator=g).to(DEV).to(memory_format=torch.channels_last)
    b = torch.randn(12, generator=g).to(DEV)
    z = torch.randn(2, 24, 6, 7, generator=g).to(DEV).to(memory_format=torch.channels_last)[:, 6:18] \
        if residual else None
    y = torch.nn.functional.conv2d(x, w, None, 1, 1)
    assert conv_epilogue.supports(tuple(y.shape), y.dtype, b, z, act, params)
    ptr = y.data_ptr()
    got = conv_epilogue.apply(y, b, z, act, params)
    assert got.data_ptr() == ptr and got.is_contiguous(memory_format=torch.channels_last)
    want = fused_conv(node, x, w, b, *([z] if residual else []))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp16_output_rounds_once():
    """FP16: the sum and activation in FP32, one rounding at the store (the reference rounds each step)."""
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(2, 16, 5, 5, generator=g) * 4).half().to(DEV).to(memory_format=torch.channels_last)
    b = torch.randn(16, generator=g).half().to(DEV)
    want = conv_epilogue.reference(y, b, None, "Silu")
    got = conv_epilogue.apply(y.clone(), b, None, "Silu")
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=1e-3)


def test_what_it_takes():
    b = torch.zeros(8)
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float32, None, None, "Silu")  # nothing to fuse
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float16, b, None, "Silu")  # bias of another type
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float32, torch.zeros(4), None, "")  # not per channel
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float32, b, None, "Mish")  # no lines for it
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float32, b, torch.zeros(1, 8, 4, 5), "")
    assert not conv_epilogue.supports((1, 8, 4, 4), torch.float32, b, None, "Clip", [0.0])
    assert conv_epilogue.supports((1, 8, 4, 4), torch.float32, b, torch.zeros(1, 8, 4, 4), "Clip", [0.0, 6.0])
    assert conv_epilogue.program("Silu", (), True) == ["Add t0 i0 i1", "Add t1 t0 i2", "Sigmoid t2 t1",
                                                       "Mul t3 t1 t2"]


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["Silu", "HardSwish", "GeluErf"])
def test_cudnn_tactic_in_fp16_on_the_gpu_and_in_a_cuda_graph(act):
    """The tactic as an engine runs it: cuDNN without the bias, the generated pass over its channels-last FP16
    output, replayed from a CUDA graph; against the layer's FP32 arithmetic."""
    from kiln.tactics.cudnn_one_epilogue import _applies, cudnn_conv_one_epilogue

    g = torch.Generator().manual_seed(9)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], {"pads": [1, 1, 1, 1], "activation": act}, domain="kiln")
    x = torch.randn(4, 32, 20, 20, generator=g).half().cuda().to(memory_format=torch.channels_last)
    w = (torch.randn(64, 32, 3, 3, generator=g) * 0.1).half().cuda().to(memory_format=torch.channels_last)
    b, z = torch.randn(64, generator=g).half().cuda(), torch.randn(4, 64, 20, 20, generator=g).half().cuda()
    assert _applies(node, [x, w, b, z])
    want = fused_conv(node, x.float(), w.float(), b.float(), z.float())
    cudnn_conv_one_epilogue(node, x, w, b, z)  # warm-up outside the capture (cuDNN's plan, Triton's compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cudnn_conv_one_epilogue(node, x, w, b, z)
    graph.replay()
    torch.cuda.synchronize()
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
