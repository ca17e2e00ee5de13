"""QAT on the digits CNN: LSQ fake quantization, Q/DQ export, onnxruntime and Kiln's CPU engine agree.

Accuracies measured here (held-out split, 360 images) are printed (pytest -s) and
asserted: INT8 QAT within 1 point of FP32; INT4-weight QAT >= INT4 PTQ - 0.5.
"""

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import kiln
from kiln.errors import ConfigError
from kiln.examples import digits
from kiln.quant import qat

PROFILE = kiln.Profile({"image": ((1, 1, 8, 8), (32, 1, 8, 8), (512, 1, 8, 8))})


@pytest.fixture(scope="module")
def trained():
    split = digits.load_split(0)
    net = digits.train(0, epochs=10, split=split)
    return net, split


def _finetune(net, split, epochs=3, lr=1e-3):
    """The user's loop: plain Adam on weights and scales."""
    return digits.fit(net, split[0], split[1], epochs, lr)


def _prepared(net, split, **kw):
    q = qat.prepare(copy.deepcopy(net), **kw)
    qat.calibrate(q, torch.from_numpy(split[0][:256]))  # PTQ: scales from one batch, no training
    return q


def _ort(model, x, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), so).run(None, {"image": x})[0]


def _close(a, b):
    """Equal up to float order, except where an activation near a rounding boundary moved one step."""
    err = np.abs(a - b)
    assert err.max() < 0.1 and (err < 1e-3).mean() > 0.995, (err.max(), (err >= 1e-3).mean())


def _kiln(model, x):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[PROFILE]))
    y = next(iter(engine.create_execution_context().run({"image": x}).values()))
    return np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y)


def test_fake_quant_rounds_to_the_grid_and_learns_its_scale():
    fq = qat.FakeQuantize(bits=4, narrow=True, axis=0, scale_shape=(3,))
    w = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    fq.initialize(w)
    torch.testing.assert_close(fq.scale.detach(), w.detach().abs().amax(1) / 7)
    y = fq(w)
    q = y / fq.scale.detach()[:, None]
    torch.testing.assert_close(q, q.round(), atol=1e-5, rtol=0)
    assert q.abs().max() <= 7 + 1e-5
    y.pow(2).sum().backward()
    assert w.grad is not None and fq.scale.grad is not None and torch.isfinite(fq.scale.grad).all()
    # Straight-through: gradient passes inside the range, stops outside it.
    fq2 = qat.FakeQuantize(bits=8)
    x = torch.tensor([0.5, -0.9, 100.0], requires_grad=True)
    fq2.initialize(torch.tensor([1.0, -1.0]))
    fq2(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0]


def test_a_step_pushed_below_zero_keeps_quantizing_and_learning():
    # an optimizer step can take the raw scale negative: its magnitude quantizes, its gradient flows
    fq = qat.FakeQuantize(bits=8)
    x = torch.linspace(-1, 1, 11)
    fq.initialize(x)
    want = fq(x).detach()
    with torch.no_grad():
        fq.scale.neg_()
    y = fq(x)
    torch.testing.assert_close(y.detach(), want)
    y.pow(2).sum().backward()
    assert fq.scale.grad is not None and float(fq.scale.grad) != 0.0
    layer = qat.calibrate(qat.prepare(nn.Linear(4, 2)), torch.randn(8, 4))
    with torch.no_grad():
        layer.weight_quant.scale.neg_()
        layer.input_quant.scale.neg_()
    model = qat.export_onnx(layer, (torch.randn(2, 4),))
    scales = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_scale")]
    assert len(scales) == 2 and all((s > 0).all() for s in scales)  # Q/DQ scales must be positive


def test_group_wise_weights_and_auto_sign():
    lin = nn.Linear(70, 5)
    net = qat.prepare(nn.Sequential(nn.ReLU(), lin), bits=8, weight_bits=4, group_size=32)
    layer = net[1]
    assert isinstance(layer, qat.QuantLinear) and layer.weight is lin.weight  # same Parameter
    assert layer.weight_quant.scale.shape == (5, 3)  # ceil(70 / 32) groups
    net(torch.randn(4, 70))
    assert not bool(layer.input_quant.signed) and layer.input_quant.qrange == (0, 255)  # after a ReLU
    with pytest.raises(ConfigError):
        qat.prepare(nn.Linear(4, 4), weight_bits=3)
    with pytest.raises(ConfigError, match="not initialized"):
        qat.export_onnx(qat.prepare(nn.Linear(4, 4)), (torch.randn(2, 4),))


@pytest.mark.parametrize("weight_bits, group_size, weight_format, per_channel", [
    (8, None, "qdq", True), (4, 32, "int", True), (8, None, "qdq", False), (8, None, "int", False)])
def test_export_runs_in_onnxruntime_and_kiln(trained, weight_bits, group_size, weight_format, per_channel):
    net, split = trained
    q = _prepared(net, split, bits=8, weight_bits=weight_bits, group_size=group_size, weight_per_channel=per_channel)
    x = split[2]
    model = qat.export_onnx(q, (torch.from_numpy(x[:2]),), input_names=["image"], weight_format=weight_format)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("DequantizeLinear") == 6 and ops.count("QuantizeLinear") == (6 if weight_format == "qdq" else 3)
    blocked = [n for n in model.graph.node if any(a.name == "block_size" for a in n.attribute)]
    assert bool(blocked) == (group_size is not None)
    weight_scales = [t for t in model.graph.initializer if t.name.endswith("weight_scale")]
    assert len(weight_scales) == 3
    assert all((list(t.dims) == []) == (not per_channel) for t in weight_scales)  # per tensor: a scalar scale
    with torch.no_grad():
        want = q(torch.from_numpy(x)).numpy()
    ref = _ort(model, x)  # reference kernels: the Q/DQ semantics exactly
    _close(ref, want)
    _close(_kiln(model, x), ref)
    # onnxruntime's fused int8 kernels (QLinearConv) may saturate u8*s8 pair sums on CPUs without VNNI:
    # only the decisions are compared.
    fused = _ort(model, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert (fused.argmax(1) == want.argmax(1)).mean() >= 0.97


def test_per_tensor_weights_on_a_depthwise_separable_net():
    """weight_per_channel=False: one LSQ step per layer (also for a depthwise conv, groups == channels), a
    scalar weight scale in the export, and onnxruntime and Kiln compute what the fake-quantized module does."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(),  # depthwise
                        nn.Conv2d(16, 32, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    with torch.no_grad():  # channel ranges spanning 100x, as BatchNorm folding leaves in depthwise convs
        net[2].weight.mul_(torch.logspace(-1, 1, 16).reshape(-1, 1, 1, 1))
    x_tr, _, x, _ = digits.load_split(0)
    q = qat.prepare(copy.deepcopy(net), bits=8, weight_bits=8, weight_per_channel=False)
    dw = q[2]
    assert dw.weight_quant.axis is None and dw.weight_quant.scale.numel() == 1
    torch.testing.assert_close(dw.weight_quant.scale.detach(), net[2].weight.abs().max() / 127)
    assert dw.weight_quant._per_scale_elements(dw.weight) == dw.weight.numel()  # LSQ's n: the whole layer
    # The smallest channel really is rounded coarsely: a few of the 255 levels (per channel: all of them).
    assert dw.weight_quant.quantize(dw.weight)[0].abs().max() <= 3
    qat.calibrate(q, torch.from_numpy(x_tr[:256]))
    y = q(torch.from_numpy(x))
    y.pow(2).mean().backward()
    assert dw.weight_quant.scale.grad is not None and torch.isfinite(dw.weight_quant.scale.grad).all()
    model = qat.export_onnx(q, (torch.from_numpy(x[:2]),), input_names=["image"])
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("weight_DequantizeLinear")]
    assert len(dq) == 4 and all(not any(a.name == "axis" for a in n.attribute) for n in dq)
    ref = _ort(model, x)
    _close(ref, y.detach().numpy())
    _close(_kiln(model, x), ref)
    with pytest.raises(ConfigError, match="exclusive"):
        qat.prepare(nn.Linear(64, 4), weight_bits=4, group_size=32, weight_per_channel=False)


def test_qat_accuracy_on_digits(trained):
    net, split = trained
    _, _, x_te, y_te = split
    fp32 = digits.accuracy(net, x_te, y_te)
    int8_ptq = _prepared(net, split, bits=8, weight_bits=8)
    acc = {"fp32": fp32, "int8_ptq": digits.accuracy(int8_ptq, x_te, y_te)}
    acc["int8_qat"] = digits.accuracy(_finetune(int8_ptq, split, epochs=2, lr=3e-4), x_te, y_te)
    int4_ptq = _prepared(net, split, bits=8, weight_bits=4)
    acc["int4_ptq"] = digits.accuracy(int4_ptq, x_te, y_te)
    acc["int4_qat"] = digits.accuracy(_finetune(int4_ptq, split, epochs=3, lr=1e-3), x_te, y_te)
    print("digits held-out top-1:", {k: round(v, 2) for k, v in acc.items()})
    assert acc["int8_qat"] >= fp32 - 1.0
    assert acc["int4_qat"] >= acc["int4_ptq"] - 0.5
    # The fine-tuned model still exports and runs in Kiln with the same decisions.
    model = qat.export_onnx(int4_ptq, (torch.from_numpy(x_te[:2]),), input_names=["image"])
    kiln_acc = 100.0 * float((_kiln(model, x_te).argmax(1) == y_te).mean())
    assert abs(kiln_acc - acc["int4_qat"]) <= 0.3
