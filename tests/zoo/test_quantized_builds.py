"""8-bit builds of the zoo's shapes of network on the CPU target: what the GPU zoo's INT8/FP8 rows found wrong.

- A ReLU CNN whose globally pooled features lie in a narrow band far from zero (any settled-BatchNorm CNN on
  random images): entropy calibration once clipped every feature to one value, and the logits were 62% off.
- A float layer reading an INT8 layer's FP16 output beside FP32 tensors in the precision guard's FP32 run (a
  pooled FC after an INT8 convolution; Swin's attention MatMul of an FP32 softmax and an FP16 value): the
  guard mixed the two types and the build failed.
"""

import pytest
import torch
from torch import nn

import kiln
from kiln import BuildConfig, Profile

from bench import zoo, zoo_models


class PooledCNN(nn.Module):
    """Two conv + BatchNorm + ReLU stages, then torchvision's head (adaptive average pool, flatten, FC: an INT8
    GEMM reads the pooled features) or a mean over the image straight into the FC (one float pooled-GEMM layer
    reading the INT8 convolution's FP16 output)."""

    def __init__(self, head: str = "flatten"):
        super().__init__()
        self.head = head
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = self.body(x)
        if self.head == "mean":
            return self.fc(y.mean((2, 3)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _net(head: str = "flatten"):
    torch.manual_seed(0)
    net = PooledCNN(head).eval()
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    zoo_models.settle_batchnorm(net, (x,), {})
    return net, x


def _build(model, x, **precision):
    proto, _ = kiln.from_torch(model, (x,), input_names=["x"])
    g = torch.Generator().manual_seed(2)
    calib = [{"x": (x + 0.1 * torch.randn(x.shape, generator=g)).numpy()} for _ in range(4)]
    prof = [Profile({"x": (tuple(x.shape),) * 3})]
    return kiln.build(proto, BuildConfig(device="cpu", progress=False, profiles=prof, calib=calib, **precision))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_pooled_features_keep_their_range(kind):
    net, x = _net()
    with torch.no_grad():
        ref = net(x)
        pooled = net.body(x).mean((2, 3))
    assert pooled.min() > 0.3 * pooled.max()  # the band that misled the entropy search
    engine = _build(net, x, fp16=True, **{kind: True})
    out = engine.create_execution_context().run({"x": x})
    err = zoo.rel_l2(list(out.values()), [ref])
    assert err < {"int8": 0.05, "fp8": 0.15}[kind], err


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_float_layer_reading_an_int8_layer_passes_the_precision_guard():
    net, x = _net("mean")
    engine = _build(net, x, fp16=True, int8=True)  # validate=True: the precision guard runs
    layers = {n.op_type: n.precision for n in engine.graph.nodes}
    assert layers["QConv"] == "int8" and layers["PooledGemm"] == "float16"
    with torch.no_grad():
        ref = net(x)
    out = engine.create_execution_context().run({"x": x})
    assert zoo.rel_l2(list(out.values()), [ref]) < 0.05


class TinyDepthHead(nn.Module):
    """Convolutions whose last output is near 1e-10 (a random-weight DPT depth head's), below FP16's smallest
    subnormal (6e-8): stored in FP16 it is all zeros."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Conv2d(16, 1, 1)
        with torch.no_grad():
            self.head.weight.mul_(1e-9)
            self.head.bias.zero_()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_8_bit_layer_whose_output_fp16_cannot_hold_writes_it_in_fp32():
    torch.manual_seed(0)
    net, x = TinyDepthHead().eval(), torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = net(x)
    assert 0 < ref.abs().max() < 6e-8
    engine = _build(net, x, fp16=True, int8=True)
    head = next(n for n in engine.graph.nodes if n.op_type == "QConv" and n.outputs[0] == engine.graph.outputs[0].name)
    assert head.attr("float_type") == "float32" and head.note.startswith("writes FP32 (precision guard): ")
    [guard] = [f for f in engine.findings if f["kind"] == "precision-guard"]
    assert head.name in guard["fp32_outputs"]
    out = engine.create_execution_context().run({"x": x})
    assert zoo.rel_l2(list(out.values()), [ref]) < 0.1  # all zeros in FP16: 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name, kind", [("resnet18", "int8"), ("bert", "fp8")])
def test_zoo_8bit_rows_track_the_fake_quant_reference(name, kind):
    """The zoo's 8-bit row: the engine's error against FP32 is the fake-quantized PyTorch reference's (measured:
    tiny ResNet-18 INT8 0.166 against 0.167, tiny BERT FP8 2.0e-3 against 1.9e-3), not more."""
    pytest.importorskip("transformers")
    entry = zoo_models.by_name([name])[0]
    prep = zoo.prepare(entry, "tiny", 2)
    row = zoo.run_case(entry, prep, kind, 2, "cpu", timing=False, torch_compile=False)
    assert row.torch_rel_l2 is not None and row.status == "ok", row
    assert row.rel_l2 <= 1.25 * row.torch_rel_l2 + 1e-4, row
