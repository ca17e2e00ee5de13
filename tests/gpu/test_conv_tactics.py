"""The depthwise / squeeze-excite CNN tactics (tactics/triton_conv.py, tactics/cudnn_benchmark.py) on a GPU: offered,
checked against the reference and timed inside a real FP16 build of a MobileNetV3-shaped block."""

import numpy as np
import pytest
import torch

import kiln

pytestmark = pytest.mark.gpu


def se_block():
    """MobileNetV3's first layers: an RGB stem (3x3 stride 2, 16 filters, HardSwish), a depthwise 3x3 + SiLU,
    a squeeze-excite block (ReduceMean over H, W; 1x1 16 -> 4 + ReLU; 1x1 4 -> 16; HardSigmoid; Mul) and a 1x1
    projection to 24 channels."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in [("ws", (16, 3, 3, 3)), ("bs", (16,)), ("wd", (16, 1, 3, 3)), ("bd", (16,)),
                          ("w1", (4, 16, 1, 1)), ("b1", (4,)), ("w2", (16, 4, 1, 1)), ("b2", (16,)),
                          ("wp", (24, 16, 1, 1))]]
    inits.append(numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes"))
    mk = helper.make_node
    nodes = [mk("Conv", ["x", "ws", "bs"], ["s"], name="stem", strides=[2, 2], pads=[1, 1, 1, 1]),
             mk("HardSwish", ["s"], ["sa"]),
             mk("Conv", ["sa", "wd", "bd"], ["d"], name="depthwise", group=16, pads=[1, 1, 1, 1]),
             mk("Sigmoid", ["d"], ["dg"]), mk("Mul", ["d", "dg"], ["da"]),
             mk("ReduceMean", ["da", "axes"], ["m"], name="pool", keepdims=1),
             mk("Conv", ["m", "w1", "b1"], ["f1"], name="fc1"), mk("Relu", ["f1"], ["r1"]),
             mk("Conv", ["r1", "w2", "b2"], ["f2"], name="fc2"), mk("HardSigmoid", ["f2"], ["g"], alpha=1 / 6),
             mk("Mul", ["da", "g"], ["e"]), mk("Conv", ["e", "wp"], ["y"], name="project")]
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 24, 32, 32])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_se_block_tactics_are_timed_and_right():
    model = se_block()
    prof = [kiln.Profile({"x": ((8, 3, 64, 64),) * 3})]
    eng = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False, profiles=prof, fp16=True))
    want = {"stem": ("triton_conv_narrow_", "cudnn_conv_benchmarked"), "depthwise": ("triton_depthwise_",),
            "pool": ("triton_spatial_mean_",), "fc1": ("triton_conv1x1_rows_",)}
    for layer, prefixes in want.items():
        t = next(t for t in eng.tactics if layer in t["layer"])
        for prefix in prefixes:  # timed, so applicable and numerically right
            assert [n for n in t["timings"] if n.startswith(prefix)], (layer, sorted(t["timings"]), t["excluded"])
        print(layer, "runs", t.get("chosen"), {k: round(v, 4) for k, v in sorted(t["timings"].items())})
    x = torch.randn(8, 3, 64, 64)
    ref = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof)).create_execution_context()
    torch.testing.assert_close(eng.create_execution_context().run({"x": x.cuda()})["y"].float().cpu(),
                               ref.run({"x": x})["y"], rtol=3e-2, atol=3e-2)


def _channels_last_weight(t):
    """As the engine stores a convolution weight on a GPU (engine.weights_on_target)."""
    _, c, h, w = t.shape
    return torch.empty_strided(t.shape, (c * h * w, 1, w * c, c), dtype=t.dtype, device=t.device).copy_(t)


@pytest.mark.parametrize("k, stride, act", [(3, 2, "Relu"), (5, 1, "HardSwish"), (3, 1, "Silu")])
def test_depthwise_kernel_matches_cudnn_at_mobilenet_shapes(k, stride, act):
    from kiln.ir.graph import Node
    from kiln.kernels import depthwise_conv
    from kiln.ops.fused import fused_conv

    node = Node("FusedConv", ["x", "w", "b"], ["y"], {"kernel_shape": [k, k], "strides": [stride, stride],
                                                      "pads": [k // 2] * 4, "group": 96, "activation": act},
                domain="kiln")
    x = torch.randn(8, 96, 28, 28, device="cuda").half().contiguous(memory_format=torch.channels_last)
    w = _channels_last_weight(torch.randn(96, 1, k, k, device="cuda").half() * 0.3)
    b = torch.randn(96, device="cuda").half()
    want = fused_conv(node, x.float(), w.float(), b.float())
    for config in depthwise_conv.CONFIGS:
        got = depthwise_conv.conv2d(node, x, w, b, config=config)
        assert got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_spatial_mean_matches_torch_on_a_large_map_of_few_channels():
    from kiln.kernels import pool

    x = torch.randn(32, 32, 112, 112, device="cuda").half().contiguous(memory_format=torch.channels_last)
    want = x.float().mean(dim=(2, 3), keepdim=True)
    for config in pool.MEAN_CONFIGS:
        torch.testing.assert_close(pool.spatial_mean(x, config=config).float(), want, atol=2e-3, rtol=2e-3)


def test_narrow_tiles_run_the_3_channel_stem():
    from kiln.ir.graph import Node
    from kiln.kernels import conv

    node = Node("FusedConv", ["x", "w", "b"], ["y"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4,
                                                      "activation": "HardSwish"}, domain="kiln")
    x = torch.randn(4, 3, 64, 64, device="cuda").half().contiguous(memory_format=torch.channels_last)
    w = _channels_last_weight(torch.randn(16, 3, 3, 3, device="cuda").half() * 0.3)
    b = torch.randn(16, device="cuda").half()
    want = conv.reference(node, x, w, b)
    for config in conv.NARROW_CONFIGS:
        torch.testing.assert_close(conv.conv2d(node, x, w, b, config=config), want, atol=2e-2, rtol=2e-2)
