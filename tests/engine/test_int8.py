"""INT8 post-training quantization end to end on a trained model (scikit-learn digits CNN, CPU)."""

import dataclasses

import numpy as np
import pytest

import kiln
from kiln.errors import ConfigError
from kiln.examples import digits
from kiln.quant.calibrate import Calibration


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    digits.main([str(out), "--exporter", "onnx"])
    return out


def _top1(engine, data):
    logits = engine.create_execution_context().run({"image": data["image"]})
    return float((next(iter(logits.values())).argmax(1) == data["labels"]).mean() * 100)


def test_int8_engine_keeps_held_out_accuracy_and_caches_calibration(trained):
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (360, 1, 8, 8))})]
    model = str(trained / "digits.onnx")
    test = dict(np.load(trained / "digits_test.npz"))
    fp32 = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof))
    cache = trained / "digits.calib"
    int8 = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof, int8=True,
                                              calib=str(trained / "digits_calib.npz"), calib_cache=str(cache)))
    assert {n.op_type for n in int8.graph.nodes} >= {"QConv", "QGemm"}
    assert {n.precision for n in int8.graph.nodes if n.op_type in ("QConv", "QGemm")} == {"int8"}
    stem = next(n for n in int8.graph.nodes if "conv1" in " ".join(n.sources or [n.name]))
    assert stem.op_type != "QConv" and "1 input channel," in stem.note  # too few channels: kept float, and why
    assert _top1(int8, test) >= _top1(fp32, test) - 0.5
    assert cache.read_text().startswith("TRT-")  # TensorRT's calibration cache text format
    # A rebuild from the cache alone gives the same engine numbers.
    again = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof, int8=True,
                                               calib_cache=str(cache)))
    x = test["image"][:32]
    np.testing.assert_allclose(again.create_execution_context().run({"image": x})["logits"],
                               int8.create_execution_context().run({"image": x})["logits"], rtol=1e-5, atol=1e-5)
    assert set(Calibration.load(cache).amax) >= {"image"}


def test_int8_without_calibration_data_is_refused(trained):
    with pytest.raises(ConfigError, match="needs calibration data"):
        kiln.build(str(trained / "digits.onnx"), kiln.BuildConfig(device="cpu", progress=False, int8=True))


def test_fp8_engine_keeps_held_out_accuracy(trained):
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (360, 1, 8, 8))})]
    model = str(trained / "digits.onnx")
    test = dict(np.load(trained / "digits_test.npz"))
    fp32 = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof))
    fp8 = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof, fp8=True,
                                             calib=str(trained / "digits_calib.npz")))
    assert {n.precision for n in fp8.graph.nodes if n.op_type in ("QConv", "QGemm")} == {"fp8"}
    assert _top1(fp8, test) >= _top1(fp32, test) - 0.5


def test_fp8_on_a_gpu_without_fp8_is_refused():
    from kiln.builder.pipeline import _check_quantized_target
    from kiln.engine.target import Target

    with pytest.raises(ConfigError, match=r"compute capability 8.9 or newer.*A100.*8.0"):
        _check_quantized_target("fp8", Target("cuda", "NVIDIA A100-SXM4-80GB", "8.0"))


def test_pinned_layers_stay_in_float(trained):
    import onnx

    model = onnx.load(str(trained / "digits.onnx"))
    first_conv = next(n.name for n in model.graph.node if n.op_type == "Conv")
    eng = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, int8=True,
                                             calib=str(trained / "digits_calib.npz"),
                                             profiles=[kiln.Profile({"image": ((1, 1, 8, 8),) * 3})],
                                             layer_precisions={first_conv: "fp32"}))
    pinned = [n for n in eng.graph.nodes if first_conv in (n.sources or [n.name])]
    assert pinned and pinned[0].op_type != "QConv" and pinned[0].precision == "float32"
    assert any(n.op_type in ("QConv", "QGemm") for n in eng.graph.nodes)
    with pytest.raises(ConfigError, match="does not have"):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, layer_precisions={"nope": "fp16"}))


def _search_cfg(trained, budget):
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (360, 1, 8, 8))})]
    return kiln.BuildConfig(device="cpu", progress=False, profiles=prof, int8=True,
                            calib=str(trained / "digits_calib.npz"), accuracy_budget=budget,
                            budget_data=str(trained / "digits_test.npz"))


def test_precision_search_keeps_full_int8_when_it_meets_the_budget(trained, monkeypatch):
    from kiln.builder import builder

    built, original = [], builder.build_engine

    def counted(model, config, calibrate=None):  # the INT8 builds (calibration builds an FP32 engine too)
        built.extend([1] if config.int8 else [])
        return original(model, config, calibrate)

    monkeypatch.setattr(builder, "build_engine", counted)
    eng = kiln.build(str(trained / "digits.onnx"), _search_cfg(trained, {"top1": 0.5}))
    report = next(f for f in eng.findings if f.get("kind") == "precision-search")
    assert report["kept_in_float"] == [] and report["engines_built"] == 1 == len(built)  # not rebuilt to validate
    assert len(eng.arena_bytes) == 1  # but validated, as a plain build is
    assert report["full_quantization_drop"]["top1"] <= 0.5
    assert any(n.precision == "int8" for n in eng.graph.nodes)


def test_precision_search_keeps_the_most_sensitive_layers_in_float(trained):
    """Real builds and engines; the metric passed in is a known one so the search's choices can be
    checked: each quantized layer costs its known sensitivity, the budget allows 1.0 point."""
    import onnx

    from kiln.passes.insert_qdq import MIN_CHANNELS
    from kiln.quant import search as search_mod

    model = onnx.load(str(trained / "digits.onnx"))
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    # the layers an INT8 build quantizes: not the 1-channel stem, which stays in float
    gemms = [n.name for n in model.graph.node if n.op_type in ("Gemm", "MatMul")
             or (n.op_type == "Conv" and shapes[n.input[1]][1] >= MIN_CHANNELS)]
    assert len(gemms) >= 2
    cost = {name: float(i + 1) for i, name in enumerate(gemms)}  # the last layer is the most sensitive

    def fake_drop(engine, model, data, budgets):
        drop = sum(cost[s] for n in engine.graph.nodes if n.precision == "int8" for s in n.sources if s in cost)
        return drop <= budgets["top1"], {"top1": drop}

    cfg = _search_cfg(trained, {"top1": 1.0})
    eng, report = search_mod.search(str(trained / "digits.onnx"), dataclasses.replace(cfg, accuracy_budget={}),
                                    cfg.accuracy_budget, cfg.budget_data, kiln.build, fake_drop)
    # Keeping layers from the most sensitive down until only cost <= 1 remains: all but the first.
    assert [k["layer"] for k in report["kept_in_float"]] == gemms[::-1][:-1]
    quantized = {s for n in eng.graph.nodes if n.precision == "int8" for s in n.sources if s in cost}
    assert quantized == {gemms[0]}


def test_a_convolution_left_in_float_says_the_build_asked_for_int8(trained):
    """The digits CNN's first convolution reads one channel, too few for 8-bit Tensor Cores: its finding says the
    build asked for INT8 there (not the build's float precision, which it does run in)."""
    eng = kiln.build(str(trained / "digits.onnx"), kiln.BuildConfig(device="cpu", progress=False, int8=True,
                                                                   calib=str(trained / "digits_calib.npz")))
    (finding,) = [f for f in eng.findings if f.get("kind") == "precision"]
    assert finding["requested"] == "int8" and finding["actual"] == "float32", finding
    assert "1 input channel" in finding["reason"]
