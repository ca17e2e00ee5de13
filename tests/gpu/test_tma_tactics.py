"""TMA GEMM and convolution tactics on a Hopper GPU: offered, checked against the reference and timed inside real
builds."""

import numpy as np
import pytest
import torch

import kiln

pytestmark = pytest.mark.gpu


def _cfg(**kw):
    # "obey": these tests check the quantized layers themselves, which a faster float tactic would replace
    return kiln.BuildConfig(device="cuda", progress=False, precision_constraints="obey", **kw)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _bottleneck_tail():
    """A 1x1 convolution of the NCHW input (its output is channels-last), a 3x3 convolution, a 1x1 convolution
    over 64 channels with a residual and ReLU (ResNet-50's layer1 conv3), then a GEMM and a softmax (the GEMM does
    not write the model's FP32 output itself, which the 16-bit TMA kernel declines)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
             for n, s in [("wi", (64, 64, 1, 1)), ("w0", (64, 64, 3, 3)), ("w", (64, 64, 1, 1)), ("b", (64,)),
                          ("wg", (64, 32)), ("bg", (32,))]]
    nodes = [helper.make_node("Conv", ["x", "wi"], ["ci"], name="conv_in"), helper.make_node("Relu", ["ci"], ["ri"]),
             helper.make_node("Conv", ["ri", "w0"], ["c0"], name="conv3x3", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w", "b"], ["c"], name="conv1x1"),
             helper.make_node("Add", ["c", "r0"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["t", "wg"], ["m"], name="gemm"), helper.make_node("Add", ["m", "bg"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "tail", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 16, 32])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(not _hopper(), reason="TMA needs sm_90")
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_tma_tactics_are_timed_and_right(precision):
    model = _bottleneck_tail()
    rng = np.random.default_rng(1)
    prof = [kiln.Profile({"x": ((1, 64, 16, 16), (8, 64, 16, 16), (8, 64, 16, 16))})]
    quant = {"int8": True, "calib": [{"x": rng.standard_normal((8, 64, 16, 16)).astype(np.float32)}
                                     for _ in range(8)]} if precision == "int8" else {}
    eng = kiln.build(model, _cfg(profiles=prof, fp16=True, optimization_level=4, **quant))
    for layer, ops in (("conv3x3", ("FusedConv", "QConv")), ("conv1x1", ("FusedConv", "QConv")),
                       ("gemm", ("FusedGemm", "QGemm"))):
        t = next(t for t in eng.tactics if layer in t["layer"] and t["op"] in ops)
        # timed, so applicable and numerically right
        assert [n for n in t["timings"] if n.startswith("triton_tma_")], (t["op"], sorted(t["timings"]), t["excluded"])
    x = torch.randn(8, 64, 16, 16)
    ref = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof)).create_execution_context()
    tol = 3e-2 if precision == "fp16" else 0.25
    torch.testing.assert_close(eng.create_execution_context().run({"x": x.cuda()})["y"].float().cpu(),
                               ref.run({"x": x})["y"], rtol=tol, atol=tol)
