"""Library tactics' CPU-checkable parts (the tactics themselves need CUDA: tests/gpu)."""

import torch

from kiln.tactics.library import storage_order


def test_storage_order_undoes_a_permutation_of_leading_axes():
    x = torch.randn(3, 5, 7)
    for view in (x.transpose(0, 1), x.permute(1, 0, 2)):
        base, perm = storage_order(view)
        assert base.is_contiguous() and base.data_ptr() == x.data_ptr()
        assert torch.equal(base.permute(perm), view)


def test_storage_order_leaves_other_layouts_alone():
    x = torch.randn(3, 5, 7)
    assert storage_order(x)[1] is None  # already contiguous
    assert storage_order(x.transpose(1, 2))[1] is None  # the GEMM axis itself moved
    assert storage_order(x[:, ::2])[1] is None  # strided, not a permutation


def test_patchify_gemm_is_the_strided_convolution():
    from kiln.ir.graph import Node
    from kiln.tactics.library import patchify_gemm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 35, 33, generator=g)  # 35x33: the last partial patch row/column is dropped
    w = torch.randn(8, 3, 4, 4, generator=g)
    b = torch.randn(8, generator=g)
    node = Node("Conv", ["x", "w", "b"], ["y"], {"strides": [4, 4], "kernel_shape": [4, 4]})
    want = torch.nn.functional.conv2d(x, w, b, stride=4)
    torch.testing.assert_close(patchify_gemm(node, x, w, b), want, atol=1e-4, rtol=1e-4)
    cl = w.contiguous(memory_format=torch.channels_last)  # as the engine stores conv weights on a GPU
    torch.testing.assert_close(patchify_gemm(node, x, cl, b), want, atol=1e-4, rtol=1e-4)


def test_fake_quantize_fallback_equals_quantize_then_scale():
    from kiln.ir.graph import Node
    from kiln.ops.fused import quantize_int8
    from kiln.tactics.library import _fake_quantized

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    x[:4] = torch.tensor([0.05, 0.15, -0.25, 20.0])  # near rounding ties, and one value that saturates
    scale = torch.tensor(0.1)
    node = Node("QGemm", [], [], {"qtype": "int8"}, domain="kiln")
    want = quantize_int8(x, scale).float() * scale
    torch.testing.assert_close(_fake_quantized(node, x, scale, torch.float32), want, rtol=0, atol=0)


def test_int8_library_gemm_with_its_one_pass_epilogue():
    """cuBLASLt's int8 GEMM (torch._int_mm, which also runs on the CPU) + kernels/rescale, against the layer
    reference; float output, and int8 output re-quantized for the next layer; weights K-major as on a GPU."""
    from kiln.builder.tactic_selection import _close
    from kiln.ir.graph import Node
    from kiln.ops.fused import qgemm
    from kiln.tactics.library import int8_int_mm

    g = torch.Generator().manual_seed(1)
    x, b = torch.randn(2, 20, 64, generator=g), torch.randn(48, generator=g)
    w = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8).t()  # [K, N] view, K contiguous
    sx, sw, sy = torch.tensor(0.02), torch.rand(48, generator=g) * 0.01, torch.tensor(0.05)
    node = Node("QGemm", [], [], {"qtype": "int8", "activation": "GeluErf"}, domain="kiln")
    node.precision = "int8"
    for y_scale in (None, sy):
        got, want = int8_int_mm(node, x, w, sx, sw, b, y_scale), qgemm(node, x, w, sx, sw, b, y_scale)
        assert got.dtype == want.dtype and _close(got, want, "int8")[0]
