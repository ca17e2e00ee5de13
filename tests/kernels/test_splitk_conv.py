import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv, splitk_conv, workspace
from kiln.kernels.splitk_gemm import SplitKConfig
from kiln.ops.fused import fused_conv

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's exp


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _node(k, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act="", params=(), group=1):
    attrs = {"kernel_shape": [k, k], "strides": list(strides), "pads": list(pads), "dilations": list(dilations),
             "group": group, "activation": act, "activation_params": list(params)}
    return Node("FusedConv", ["x", "w", "b", "z"], ["y"], attrs, domain="kiln")


def _small(slices):  # several pixel and channel tiles, channel remainders
    return SplitKConfig(slices, 16, 16, 16, num_stages=1)


CASES = {
    # name: (C, OC, node, slices, residual shape ("full" / "broadcast" / None), channels-last x, bias)
    # 3 channel blocks x 9 taps = 27 iterations over 4 slices of 7: the last slice is shorter
    "3x3_stride2_residual_relu": (40, 9, _node(3, strides=(2, 2), pads=(1, 1, 1, 1), act="Relu"), 4, "full",
                                  True, True),
    # 33 channels: a block of one channel; 27 iterations over 5 slices of 6
    "dilated_asymmetric_pads": (33, 17, _node(3, strides=(2, 1), pads=(1, 0, 2, 1), dilations=(2, 2),
                                              act="LeakyRelu", params=[0.1]), 5, None, False, True),
    # 1x1 over 36 channels: 3 iterations, so 8 slices become 3 of one iteration
    "more_slices_than_iterations": (36, 20, _node(1, act="Silu"), 8, "broadcast", True, False),
    # C < 32: flat K of 45 in 3 blocks of 16 over 2 slices
    "flat_small_c": (5, 7, _node(3, pads=(1, 1, 1, 1), act="Relu"), 2, "full", False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    C, OC, node, slices, residual, cl, bias = CASES[case]
    x, w = _rand(2, C, 5, 7, seed=1), _rand(OC, C, *node.attr("kernel_shape"), seed=2)
    b = _rand(OC, seed=3) if bias else None
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    oh, ow = conv.geometry(node, x, w)[3]
    z = {"full": _rand(2, OC, oh, ow, seed=4), "broadcast": _rand(1, OC, 1, ow, seed=4), None: None}[residual]
    cfg = _small(slices)
    assert splitk_conv.supports(node, x, w, b, z, cfg)
    y = poisoned(lambda: splitk_conv.conv2d_splitk(node, x, w, b, z, config=cfg))
    assert y.shape == (2, OC, oh, ow) and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, conv.reference(node, x, w, b, z), atol=1e-4, rtol=1e-4)


def test_fp16_inputs():
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    x, w = _rand(1, 48, 3, 5, seed=5, dtype=torch.float16), _rand(24, 48, 3, 3, seed=6, dtype=torch.float16)
    b, z = _rand(24, seed=7, dtype=torch.float16), _rand(1, 24, 3, 5, seed=8, dtype=torch.float16)
    y = splitk_conv.conv2d_splitk(node, x, w, b, z, config=_small(4))
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, conv.reference(node, x, w, b, z), atol=2e-2, rtol=2e-2)


def test_one_kernel_leaves_its_workspace_zero_for_the_next_call():
    """The last slice of each tile takes the sum and zeroes it and the tile's counter: a second call (as a
    CUDA graph replays it) starts from zeros again and gives the same result."""
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    x, w = _rand(1, 40, 6, 6, seed=9), _rand(20, 40, 3, 3, seed=10)
    first = splitk_conv.conv2d_splitk(node, x, w, config=_small(3))
    total, counters = workspace.zeroed_workspace(x.device, 1, 1)
    assert int(total.count_nonzero()) == 0 and int(counters.count_nonzero()) == 0
    torch.testing.assert_close(splitk_conv.conv2d_splitk(node, x, w, config=_small(3)), first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first, conv.reference(node, x, w), atol=1e-4, rtol=1e-4)


def test_slices_cover_the_iterations_and_none_is_empty():
    assert splitk_conv.slicing(27, 4) == (7, 4)
    assert splitk_conv.slicing(10, 8) == (2, 5)  # 8 slices of 2 would leave 3 empty
    assert splitk_conv.slicing(3, 8) == (1, 3)
    for iters in range(1, 80):
        for slices in (1, 2, 3, 4, 8, 16):
            per, count = splitk_conv.slicing(iters, slices)
            assert count <= slices and per * (count - 1) < iters <= per * count, (iters, slices)
    # ResNet-50's layer4 3x3 (512 channels, 64-channel blocks): 72 iterations
    assert splitk_conv.k_iterations(splitk_conv.CONFIGS[0], torch.empty(512, 512, 3, 3, device="meta")) == 72


def test_supports_refuses_quantized_weights_and_grouped_convolutions():
    node, cfg = _node(3, pads=(1, 1, 1, 1)), _small(4)
    x, w = torch.randn(1, 40, 5, 7), torch.randn(6, 40, 3, 3)
    assert splitk_conv.supports(node, x, w, None, None, cfg)
    assert not splitk_conv.supports(node, x, w.to(torch.int8), None, None, cfg)
    assert not splitk_conv.supports(_node(3, group=2), x, torch.randn(6, 20, 3, 3), None, None, cfg)


# --- the registered tactics ---------------------------------------------------------------
def _splitk_tactics():
    from kiln.tactics import _TACTICS, triton_gemm  # noqa: F401  (registers)

    return [t for t in _TACTICS[("kiln", "FusedConv")] if t.name.startswith("triton_conv_splitk_")]


def test_tactic_names_and_levels():
    tactics = _splitk_tactics()
    assert [t.name for t in tactics] == [f"triton_conv_splitk_{c.name}" for c in splitk_conv.CONFIGS]
    assert "triton_conv_splitk_s8_64x64x64_w4_s4" in {t.name for t in tactics}
    assert all(t.level == 3 for t in tactics)


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_offered_to_few_pixel_deep_k_layers_only(monkeypatch):
    """ResNet-50's 3x3 convolutions at batch 1 are offered every configuration; batch 32, a 1x1 with K = 256,
    the RGB stem and FP32 without TF32 none. (No CUDA here: the device and shared-memory checks are stubbed.)"""
    from kiln.tactics import triton_gemm

    monkeypatch.setattr(triton_gemm, "_precision_ok",
                        lambda node, args, quant, n_dim: triton_gemm._dtype_ok(node, args[0]))
    monkeypatch.setattr(triton_gemm, "_fits", lambda x, smem_bytes: smem_bytes <= 232448)  # an H200's opt-in limit
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")

    def offered(x, w, z=None, node=node):
        return [t.applies(node, [x, w, _meta(w.shape[0]), z]) for t in _splitk_tactics()]

    layer4, layer3 = (_meta(1, 512, 7, 7), _meta(512, 512, 3, 3)), (_meta(1, 256, 14, 14), _meta(256, 256, 3, 3))
    assert all(offered(*layer4, z=_meta(1, 512, 7, 7))) and all(offered(*layer3))
    assert not any(offered(_meta(32, 512, 7, 7), layer4[1]))  # 200 tiles of 64x64 fill the GPU
    assert all(offered(_meta(1, 64, 56, 56), _meta(64, 64, 3, 3)))  # layer1's 3x3: K = 576, 49 tiles
    assert not any(offered(_meta(1, 256, 56, 56), _meta(64, 256, 1, 1), node=_node(1)))  # K = 256
    stem = _node(7, strides=(2, 2), pads=(3, 3, 3, 3), act="Relu")
    assert not any(offered(_meta(1, 3, 224, 224), _meta(64, 3, 7, 7), node=stem))  # flat K walk
    fp32 = _meta(1, 512, 7, 7, dtype=torch.float32), _meta(512, 512, 3, 3, dtype=torch.float32)
    assert not any(offered(*fp32))  # exact FP32 is left to cuDNN
    node.precision = "tf32"
    assert all(offered(*fp32))


def test_every_tactic_matches_the_layer_reference():
    node = _node(3, pads=(1, 1, 1, 1), act="Relu")
    node.precision = "tf32"
    x = _rand(1, 128, 3, 3, seed=9).to(memory_format=torch.channels_last)  # K = 1152: 18 iterations of 64
    w, b, z = _rand(20, 128, 3, 3, seed=10), _rand(20, seed=11), _rand(1, 20, 3, 3, seed=12)
    want = fused_conv(node, x, w, b, z)
    # TF32 on a GPU (10-bit mantissas): sums of 1152 products of about 34 in magnitude are off by ~1e-2
    atol, rtol = (1e-3 * want.abs().max().item(), 1e-2) if DEV == "cuda" else (1e-4, 1e-4)
    for t in _splitk_tactics():
        assert t.applies(node, [x, w, b, z]) == x.is_cuda, t.name  # CPU tensors are refused
        torch.testing.assert_close(t.fn(node, x, w, b, z), want, atol=atol, rtol=rtol, msg=t.name)
