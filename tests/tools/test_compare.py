"""kiln compare: engine vs onnxruntime (and vs a PyTorch module), Polygraphy-style statistics."""

import json

import numpy as np
import pytest

from kiln.errors import ConfigError, InputError, ShapeError
from kiln.tools import compare as tool
from kiln.tools.compare import compare, compare_arrays

from .conftest import cli


def test_fp32_engine_matches_onnxruntime_with_default_tolerance(mlp_files, capsys, tmp_path):
    rc = cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp32), "--samples", "2", "--json",
             str(tmp_path / "c.json"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "rtol=0.0001" in out and "Tolerance: atol=" in out  # FP32 default (atol relative to the range)
    assert "PASSED | Output: 'y'" in out and "PASSED | All outputs matched" in out
    for field in ("Absolute error: max=", "median=", "p99=", "Relative error:", "NaN/Inf: engine 0 NaN",
                  "Minimum tolerance that would pass", "Absolute error histogram"):
        assert field in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["passed"] and data["samples"] == 2 and data["outputs"][0]["elements"] == 2 * 4 * 4


def test_fp16_fails_tight_tolerance_and_min_tolerance_is_exact(mlp_files, capsys):
    rc = cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp16), "--atol", "1e-6", "--rtol", "0")
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED | Output: 'y'" in out and "exceed the tolerance; worst at index" in out
    res = compare(str(mlp_files.onnx), mlp_files.engine16, atol=1e-6, rtol=0.0)
    need = res.outputs[0].min_atol
    assert need > 1e-6
    # the reported minimum tolerance passes; anything tighter fails
    assert compare(str(mlp_files.onnx), mlp_files.engine16, atol=need * 1.0001, rtol=0.0).passed
    assert not compare(str(mlp_files.onnx), mlp_files.engine16, atol=need * 0.99, rtol=0.0).passed
    # FP16's default tolerance (1e-2) passes, and a per-output override is honoured
    assert compare(str(mlp_files.onnx), mlp_files.engine16).passed
    assert cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp16), "--atol", "1e-6", "--atol",
               f"y:{need * 1.01}", "--rtol", "0") == 0


def test_layerwise_names_first_layer_out_of_tolerance(mlp_files, capsys):
    rc = cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp16), "--layerwise", "--atol", "1e-5",
             "--rtol", "1e-5")
    out = capsys.readouterr().out
    assert rc == 1
    res = compare(str(mlp_files.onnx), mlp_files.engine16, atol=1e-5, rtol=1e-5, layerwise=True)
    assert [lr.tensor for lr in res.layers] == ["h2", "y"]  # the fused layers' outputs that exist in the ONNX graph
    assert res.first_bad_layer.index == 0 and res.first_bad_layer.layer == "fc1 + fc1_bias + relu"
    assert "First layer whose error leaves tolerance: #0 fc1 + fc1_bias + relu" in out
    ok = compare(str(mlp_files.onnx), mlp_files.engine32, layerwise=True)
    assert ok.passed and ok.first_bad_layer is None and len(ok.layers) == 2


def test_inputs_from_npz_and_folder(mlp_files, tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, n in enumerate((1, 5, 16)):
        np.savez(folder / f"s{i}.npz", x=rng.standard_normal((n, 8)).astype(np.float32))
    assert cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp32), "--loadInputs", str(folder)) == 0
    one = tmp_path / "one.npz"
    np.savez(one, x=rng.standard_normal((40, 8)).astype(np.float32), labels=np.zeros(40))
    assert cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp32), "--loadInputs", str(one)) == 0  # 16+16+8
    np.savez(tmp_path / "bad.npz", image=np.zeros((2, 8), np.float32))
    with pytest.raises(InputError, match=r"\['image'\] are not inputs of the engine"):
        cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp32), "--loadInputs", str(tmp_path / "bad.npz"))
    with pytest.raises(ShapeError, match="axis 1 is 9"):
        compare(str(mlp_files.onnx), mlp_files.engine32, [{"x": np.zeros((2, 9), np.float32)}])


def test_bindings_that_differ_are_named(mlp_files, digits):
    with pytest.raises(InputError, match=r"input names differ: the reference has \['image'\], the engine has \['x'\]"):
        compare(str(digits.ex.onnx_path), mlp_files.engine32)
    with pytest.raises(ConfigError, match="is an engine"):
        compare(str(mlp_files.fp16), mlp_files.engine32)
    with pytest.raises(ConfigError, match="--atol"):
        cli(tool, "compare", str(mlp_files.onnx), str(mlp_files.fp32), "--atol", "logits:1e-3")


def test_pytorch_module_reference(digits):
    res = compare(digits.ex.module, digits.fp32, seed=1)
    assert res.passed and "PyTorch" in res.reference
    assert res.outputs[0].abs_err["max"] < 1e-4


def test_nan_and_shape_mismatch_fail_clearly():
    ref = np.array([1.0, 2.0, 3.0], np.float32)
    out = np.array([1.0, np.nan, 3.0], np.float32)
    r = compare_arrays("y", [ref], [out], 1e-3, 1e-3)
    assert not r.passed and r.engine_nan == 1 and "NaN/Inf in one of engine and reference" in r.reason
    both = compare_arrays("y", [np.array([np.nan, 1.0])], [np.array([np.nan, 1.0])], 0, 0)
    assert both.passed  # NaN where the reference is NaN too is a match
    r = compare_arrays("y", [np.zeros((2, 3))], [np.zeros((3, 2))], 1, 1)
    assert not r.passed and "shape differs: the engine returns 3x2, the reference 2x3" in r.reason


def test_default_atol_is_relative_to_the_outputs_rms_and_an_explicit_one_is_absolute():
    ref = np.array([100.0, -80.0, 0.5])
    out = ref + np.array([0.06, -0.05, 0.001])  # FP16-sized steps on large logits
    scaled = compare_arrays("logits", [ref], [out], 1e-2, 0.0, of_scale=True)
    rms = float(np.sqrt(np.mean(ref ** 2)))
    assert scaled.passed and scaled.atol == pytest.approx(1e-2 * rms)
    assert scaled.atol_basis == f"0.01 x RMS(ref) {rms:.4g}"
    assert not compare_arrays("logits", [ref], [out], 1e-2, 0.0).passed
    # small outputs get a small tolerance: no floor of 1 that would swallow them
    small = compare_arrays("probs", [np.array([0.05, 0.02])], [np.array([0.06, 0.02])], 1e-2, 0.0, of_scale=True)
    assert small.atol < 1e-3 and not small.passed
