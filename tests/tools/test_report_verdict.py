"""kiln report reads compare's verdict: a vacuous (INCONCLUSIVE) check is neither a match nor a mismatch."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tools.report import build_report, write_report


def _offset_model(path):
    """y = 1e-3 * x + 100: the output's spread (about 0.006) is below FP32's default tolerance, 1e-4 x RMS (0.01)."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])], "offset",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(np.array(1e-3, np.float32), "k"), numpy_helper.from_array(np.array(100, np.float32), "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def test_inconclusive_compare_is_not_reported_as_a_mismatch(tmp_path):
    path = tmp_path / "offset.onnx"
    _offset_model(path)
    engine = kiln.build(str(path), kiln.BuildConfig(device="cpu", progress=False))
    rep = build_report(engine, reference=str(path), run_bench=False)
    assert rep.compare.verdict == "INCONCLUSIVE"
    accuracy = rep.litmus[2]
    assert accuracy.status == "warn"
    assert "DO NOT match" not in accuracy.answer and "vacuous" in accuracy.answer
    assert "SYNTHETIC inputs" in accuracy.answer and "x: standard normal" in accuracy.answer
    html, md = (p.read_text() for p in write_report(rep, tmp_path / "r"))
    assert "**INCONCLUSIVE**" in md and "vacuous: the constant" in md
    assert "SYNTHETIC inputs, not data" in html


def test_loaded_inputs_are_named(tmp_path):
    path = tmp_path / "offset.onnx"
    _offset_model(path)
    engine = kiln.build(str(path), kiln.BuildConfig(device="cpu", progress=False))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 1e4  # spread far above tolerance
    rep = build_report(engine, reference=str(path), run_bench=False, samples=[{"x": x}],
                       samples_label="--loadInputs x.npz")
    assert rep.compare.verdict == "PASSED"
    assert "outputs match the reference" in rep.litmus[2].answer and "--loadInputs x.npz" in rep.litmus[2].answer
