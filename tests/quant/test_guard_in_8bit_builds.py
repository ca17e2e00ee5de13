"""The precision guard (builder/precision.guard) in 8-bit builds: the float layers of an INT8 engine that
overflow FP16 are kept in FP32, in the builds kiln.build compares for a GPU engine too (quant/speed.py builds
them without the validation run)."""

import numpy as np
import pytest
import torch

import kiln
from kiln import BuildConfig
from kiln.quant import speed


class SumOfSquares(torch.nn.Module):
    """An INT8 GEMM whose outputs (|h| near 100) are normalized by their sum of squares over 256 features: about
    1e6, past FP16's 65504 (magika's FP16 failure)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 256)
        with torch.no_grad():
            self.fc.weight.mul_(800.0)

    def forward(self, x):
        h = self.fc(x)
        return h / torch.sqrt((h * h).sum(-1, keepdim=True))


def _model():
    torch.manual_seed(0)
    net = SumOfSquares().eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref, h = net(x), net.fc(x)
    assert float((h * h).sum(-1).max()) > 65504 * 4  # what the guard is for
    model, _ = kiln.from_torch(net, (x,))
    rng = np.random.default_rng(0)
    calib = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(25)]
    return model, x, ref, calib


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_builds_compared_for_an_8bit_engine_keep_an_overflowing_float_layer_in_fp32():
    model, x, ref, calib = _model()
    config = BuildConfig(device="cpu", progress=False, fp16=True, int8=True, calib=calib)
    # kiln.build's path for a GPU 8-bit build, on the CPU target (where it stops after the quantized engine:
    # there are no timings to compare); its builds skip the validation run
    engine, report = speed.keep_faster_float(model, config, kiln.build, latency=None)
    assert report["kind"] == "precision-by-speed" and report["engines_built"] == 1
    layers = {n.name: n for n in engine.graph.nodes}
    assert any(n.precision == "int8" for n in layers.values())
    guarded = {f["layer"]: f["reason"] for f in engine.findings
               if f["kind"] == "precision" and "precision guard" in f["reason"]}
    assert guarded and all(layers[name].precision == "float32" for name in guarded), guarded
    summary = next(f for f in engine.findings if f["kind"] == "precision-guard")
    assert sorted(summary["kept_fp32"]) == sorted(guarded)
    out = next(iter(engine.create_execution_context().run({"x": x}).values()))
    assert torch.isfinite(out).all() and _rel(out, ref) < 0.05

    unguarded, _ = speed.keep_faster_float(model, BuildConfig(device="cpu", progress=False, fp16=True, int8=True,
                                                              calib=calib, precision_guard=False),
                                           kiln.build, latency=None)
    bad = next(iter(unguarded.create_execution_context().run({"x": x}).values()))
    assert not (torch.isfinite(bad).all() and _rel(bad, ref) < 0.05)  # FP16's overflow, left alone


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_8bit_build_without_the_validation_run_still_guards_its_float_layers():
    model, x, ref, calib = _model()
    engine = kiln.build(model, BuildConfig(device="cpu", progress=False, fp16=True, int8=True, calib=calib,
                                           validate=False))
    assert any(f["kind"] == "precision-guard" for f in engine.findings)
    out = next(iter(engine.create_execution_context().run({"x": x}).values()))
    assert _rel(out, ref) < 0.05
