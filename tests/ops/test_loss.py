"""Hand tests for loss.py: the losses against torch's cross_entropy / nll_loss with class weights,
an ignore_index outside the class range and every reduction, the log-probability output, an FP16 build."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln

rng = np.random.default_rng(0)


def _model(op, outputs, opset=13, with_weight=True, **attrs):
    node = helper.make_node(op, ["x", "t"] + (["w"] if with_weight else []), outputs, name="loss", **attrs)
    vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 4]),
           helper.make_tensor_value_info("t", TensorProto.INT64, [3, 4])]
    if with_weight:
        vis.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [5]))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    return helper.make_model(helper.make_graph([node], "g", vis, outs),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def _run(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, validate=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


_FEEDS = {"x": rng.standard_normal((3, 5, 4)).astype(np.float32),
          "t": np.array([[0, 4, -100, 2], [1, 1, 3, -100], [4, 0, 2, 2]], np.int64),
          "w": rng.random(5).astype(np.float32) + 0.5}


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy_matches_torch(reduction):
    model = _model("SoftmaxCrossEntropyLoss", ["loss", "log_prob"], reduction=reduction, ignore_index=-100)
    loss, log_prob = _run(model, _FEEDS)
    x, t, w = (torch.from_numpy(_FEEDS[k]) for k in "xtw")
    want = torch.nn.functional.cross_entropy(x, t, weight=w, ignore_index=-100, reduction=reduction)
    np.testing.assert_allclose(loss, want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log_prob, torch.log_softmax(x, 1).numpy(), rtol=1e-5, atol=1e-6)


def test_nll_loss_without_weights_and_fp16_build():
    model = _model("NegativeLogLikelihoodLoss", ["loss"], with_weight=False, ignore_index=-100)
    feeds = {k: _FEEDS[k] for k in "xt"}
    want = torch.nn.functional.nll_loss(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["t"]), ignore_index=-100)
    (got,) = _run(model, feeds)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    (got16,) = _run(model, feeds, fp16=True)
    np.testing.assert_allclose(got16, want.numpy(), rtol=2e-3)
