"""Never fail where a slower path exists: tactics that raise or disagree are dropped with a finding, layers
that overflow or drift in FP16/BF16 stay FP32 with a finding, and channels-last weights never reshape
anything but a convolution's input."""

import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch

import kiln
from kiln import BuildConfig, Profile
from kiln.builder.builder import validate
from kiln.engine.interpreter import TacticFallbackWarning
from kiln.tactics import _BY_NAME, _TACTICS, tactic
from kiln.tools.inspect import describe_finding, inspect_engine


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class ConcatHead(torch.nn.Module):
    """A YOLO-style neck: two branches of different widths concatenated, a 1x1 convolution, `1 - y`
    (Sub with a scalar first) and a product with a scalar."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 32, 1)
        self.c = torch.nn.Conv2d(48, 8, 1)

    def forward(self, x):
        a = torch.relu(self.a(x))
        b = torch.relu(self.b(a))
        y = self.c(torch.cat([a, b], 1))
        return 0.5 * (1.0 - torch.sigmoid(y))


@pytest.mark.parametrize("precision", [{}, {"fp16": True}])
def test_channels_last_weights_leave_concatenations_alone(precision):
    """A GPU engine stores convolution weights channels-last; activations then come channels-last too.
    Only a convolution's input may be padded to its weight's channels (FP16 builds of a detector had a
    Concat's first input padded, and a conv then got 256 channels instead of 192)."""
    torch.manual_seed(0)
    net = ConcatHead().eval()
    x = torch.randn(1, 3, 16, 16)
    model, _ = kiln.from_torch(net, (x,))
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False, **precision))
    engine.channels_last = sorted(n for n, t in engine.graph.initializers.items() if t.dim() == 4)
    engine._device_weights = None  # place the weights again, channels-last, as on a GPU
    out = list(engine.create_execution_context().run([x]).values())[0]
    with torch.no_grad():
        assert _rel(out.float(), net(x)) < (2e-3 if precision else 1e-6)


class TwoBranchStem(torch.nn.Module):
    """RepVGG's stem: a 3x3 and a 1x1 convolution both reading the RGB image, summed."""

    def __init__(self):
        super().__init__()
        self.k3 = torch.nn.Conv2d(3, 32, 3, padding=1)  # 32 filters: padded (builder/layout.MIN_PADDED_FILTERS)
        self.k1 = torch.nn.Conv2d(3, 32, 1)

    def forward(self, x):
        return torch.relu(self.k3(x) + self.k1(x))


def test_padded_stem_weights_pad_the_image_for_a_1x1_branch_too():
    """A GPU engine gives RGB stem weights a zero fourth channel and pads the image to match; a 1x1 weight
    reads as contiguous in both layouts, and its branch got the unpadded image (RepVGG-A0 FP16 on the H200:
    'weight of size [48, 4, 1, 1], expected input[1, 3, 224, 224] to have 4 channels')."""
    from kiln.builder import layout

    torch.manual_seed(0)
    net = TwoBranchStem().eval()
    x = torch.randn(1, 3, 8, 8)
    model, _ = kiln.from_torch(net, (x,))
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False))
    engine.channels_last = sorted(n for n, t in engine.graph.initializers.items() if t.dim() == 4)
    engine.padded_channels = layout.padded_channel_weights(engine.graph, engine.channels_last)
    assert len(engine.padded_channels) == 2
    engine._device_weights = None
    out = list(engine.create_execution_context().run([x]).values())[0]
    with torch.no_grad():
        assert _rel(out, net(x)) < 1e-6


class Overflow(torch.nn.Module):
    """A MatMul whose values pass FP16's 65504, then a LayerNorm that brings them back to O(1)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.ln = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 8)
        with torch.no_grad():
            self.fc.weight.mul_(40000.0)

    def forward(self, x):
        return self.head(self.ln(self.fc(x)))


def test_fp16_overflow_is_kept_fp32_with_a_finding():
    torch.manual_seed(0)
    net = Overflow().eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref, peak = net(x), float(net.fc(x).abs().max())
    assert peak > 65504
    model, _ = kiln.from_torch(net, (x,))
    unguarded = kiln.build(model, BuildConfig(device="cpu", progress=False, fp16=True, precision_guard=False))
    bad = list(unguarded.create_execution_context().run([x]).values())[0]
    assert not torch.isfinite(bad).all()  # what the guard is for
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False, fp16=True))
    out = list(engine.create_execution_context().run([x]).values())[0]
    assert _rel(out.float(), ref) < 1e-2
    kept = {f["layer"]: f["reason"] for f in engine.findings if f["kind"] == "precision"}
    assert len(kept) == 2 and all("precision guard" in r for r in kept.values())
    assert any("overflows FP16" in r for r in kept.values())
    assert any("FP16's largest value 65504" in r for r in kept.values())
    head = next(n for n in engine.graph.nodes if n.name not in kept and n.placement == "device")
    assert head.precision == "float16"  # the layers after the normalization stay FP16
    summary = next(f for f in engine.findings if f["kind"] == "precision-guard")
    assert sorted(summary["kept_fp32"]) == sorted(kept)
    texts = [describe_finding(f) for f in inspect_engine(engine, measure=False).findings]
    assert any("runs in float32, the build requested float16" in t and "overflows" in t for t in texts)


def test_bf16_build_of_the_same_model_needs_no_fallback():
    torch.manual_seed(0)
    net = Overflow().eval()
    x = torch.randn(4, 64)
    model, _ = kiln.from_torch(net, (x,))
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False, bf16=True))
    assert not [f for f in engine.findings if f["kind"] == "precision-guard"]
    with torch.no_grad():
        assert _rel(list(engine.create_execution_context().run([x]).values())[0].float(), net(x)) < 5e-2


def _magika_model():
    spec = importlib.util.find_spec("magika")
    if spec is None:
        pytest.skip("magika is not installed (pip install -e '.[zoo]')")
    path = os.path.join(spec.submodule_search_locations[0], "models", "standard_v3_3", "model.onnx")
    if not os.path.exists(path):
        pytest.skip(f"this magika release has no {path}")
    return path


def test_real_classifier_that_drifts_in_fp16_is_kept_correct():
    """magika's file-type classifier (a real ONNX file) returned wrong FP16 outputs (relative L2 1.03 against
    onnxruntime) through a sum of squares past 65504; the guard keeps that layer in FP32."""
    path = _magika_model()
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(0).integers(0, 257, (2, 2048)).astype(np.int32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"bytes": x})[0]
    engine = kiln.build(path, BuildConfig(device="cpu", progress=False, fp16=True,
                                          profiles=[Profile({"bytes": ((1, 2048), (2, 2048), (4, 2048))})]))
    out = list(engine.create_execution_context().run({"bytes": x}).values())[0]
    assert _rel(out, ref) < 1e-2
    assert any(f["kind"] == "precision-guard" for f in engine.findings)


@pytest.fixture
def raising_tactic():
    """A FusedGemm tactic that raises on every call, registered for one test."""
    name = "zoo_test_raises"

    def fn(node, x, w, b=None):
        raise RuntimeError("no kernel image for this shape")

    tactic("FusedGemm", name, applies=lambda node, args: True, level=1)(fn)
    yield name
    _TACTICS[("kiln", "FusedGemm")] = [t for t in _TACTICS[("kiln", "FusedGemm")] if t.name != name]
    _BY_NAME.pop(("kiln", "FusedGemm", name), None)


def test_a_chosen_tactic_that_raises_falls_back_to_the_reference(raising_tactic):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    model, _ = kiln.from_torch(net, (x,))
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False))
    gemms = [n for n in engine.graph.nodes if n.op_type == "FusedGemm"]
    assert gemms
    gemms[0].tactic = raising_tactic  # as if the build had chosen it at another shape
    with pytest.warns(TacticFallbackWarning, match=raising_tactic):
        out = list(engine.create_execution_context().run([x]).values())[0]
    with torch.no_grad():
        torch.testing.assert_close(out, net(x), rtol=1e-5, atol=1e-5)
    validate(engine)  # the build's validation run turns the failure into a finding
    found = [f for f in engine.findings if f["kind"] == "tactic"]
    assert found and found[0]["layer"] == gemms[0].name and found[0]["tactic"] == raising_tactic
    assert "no kernel image" in found[0]["reason"] and gemms[0].tactic == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no more failures: the layer now runs the reference
        engine.create_execution_context().run([x])


@pytest.mark.gpu
def test_gpu_build_drops_tactics_that_raise_or_disagree(raising_tactic):
    def wrong(node, x, w, b=None):
        return torch.matmul(x, w) * 1.5

    tactic("FusedGemm", "zoo_test_wrong", applies=lambda node, args: True, level=1)(wrong)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
        x = torch.randn(4, 64)
        model, _ = kiln.from_torch(net, (x,))
        engine = kiln.build(model, BuildConfig(device="cuda", progress=False, fp16=True))
        found = {(f["layer"], f["tactic"]): f["reason"] for f in engine.findings if f["kind"] == "tactic"}
        layers = [n.name for n in engine.graph.nodes if n.op_type == "FusedGemm"]
        for layer in layers:
            assert found[(layer, raising_tactic)].startswith("failed: RuntimeError")
            assert found[(layer, "zoo_test_wrong")].startswith("numerically wrong")
        out = list(engine.create_execution_context().run([x.cuda()]).values())[0]
        with torch.no_grad():
            assert _rel(out.float().cpu(), net(x)) < 1e-2
    finally:
        _TACTICS[("kiln", "FusedGemm")] = [t for t in _TACTICS[("kiln", "FusedGemm")] if t.name != "zoo_test_wrong"]
        _BY_NAME.pop(("kiln", "FusedGemm", "zoo_test_wrong"), None)


def test_a_scalar_first_input_beside_a_channels_last_activation_is_left_alone():
    """cast_for once read any channels-last 4-D second input as a convolution weight: Sub(1.0, x) with x
    channels-last indexed the scalar's channels (IndexError: tuple index out of range, PP-OCR FP16 on the H200)."""
    from kiln.engine.interpreter import cast_for
    from kiln.ir.graph import Node
    from kiln.ops.registry import lookup

    node = Node("Sub", ["one", "x"], ["y"], name="sub")
    node.precision = "float16"
    x = torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    one = torch.tensor(1.0)
    a, b = cast_for(node, lookup("Sub"), [one, x])
    assert a.shape == () and b.shape == x.shape and b.dtype == torch.float16
