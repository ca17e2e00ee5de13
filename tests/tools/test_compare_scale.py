"""kiln compare on a small output: tolerances scale with it, a vacuous check is not a PASS, inputs are named."""

import json

import numpy as np
import onnx
import pytest

import kiln
from kiln.tools import compare as tool
from kiln.tools.compare import compare, compare_arrays, vacuous

from .conftest import CPU, cli
from .text_model import text_classifier, token_batch

SEQ = 16
PROFILE = {"input_ids": ((1, SEQ), (8, SEQ), (64, SEQ)), "attention_mask": ((1, SEQ), (8, SEQ), (64, SEQ))}


@pytest.fixture(scope="module")
def int8_text(tmp_path_factory):
    """The tiny text classifier (logits span ~0.05) as ONNX and as an INT8 engine calibrated on token batches."""
    d = tmp_path_factory.mktemp("text")
    onnx.save(text_classifier(), d / "text.onnx")
    np.savez(d / "calib.npz", **token_batch(128, SEQ, seed=1))
    np.savez(d / "heldout.npz", **token_batch(32, SEQ, seed=2))
    engine = kiln.build(str(d / "text.onnx"), kiln.BuildConfig(profiles=[kiln.Profile(PROFILE)], int8=True,
                                                               calib=str(d / "calib.npz"), **CPU))
    engine.save(d / "text_int8.kiln")
    return d, engine


def test_int8_engine_with_small_logits_fails_where_the_old_atol_passed(int8_text, capsys, tmp_path):
    d, engine = int8_text
    heldout = dict(np.load(d / "heldout.npz"))
    # The old default, atol 0.1 x max(1, max|ref|) = 0.1 and rtol 0.1, is wider than the logits' whole range:
    old = compare(str(d / "text.onnx"), engine, [heldout], atol=0.1, rtol=0.1)
    o = old.outputs[0]
    assert o.mismatches == 0 and o.vacuous  # nothing could fail it: a constant output passes too
    assert o.verdict == "INCONCLUSIVE" and not old.passed
    # The default now scales with the output and fails the engine that lost its logits.
    new = compare(str(d / "text.onnx"), engine, [heldout])
    n = new.outputs[0]
    rs = n.reference_stats
    assert rs["max"] - rs["min"] < 0.1  # the output is small: the case the old atol missed
    assert n.atol < 0.1 * (rs["max"] - rs["min"]) and "RMS(ref)" in n.atol_basis
    assert not n.vacuous and n.verdict == "FAILED"
    # The command line: INCONCLUSIVE exits 3, the default FAILED exits 1, and --accept-vacuous passes it.
    args = (str(d / "text.onnx"), str(d / "text_int8.kiln"), "--loadInputs", str(d / "heldout.npz"))
    assert cli(tool, "compare", *args, "--atol", "0.1", "--rtol", "0.1", "--json", str(tmp_path / "c.json")) == 3
    out = capsys.readouterr().out
    assert "VACUOUS CHECK" in out and "INCONCLUSIVE | Output: 'logits'" in out
    assert "Tolerance against the output: up to" in out and "the reference spans" in out
    assert json.loads((tmp_path / "c.json").read_text())["verdict"] == "INCONCLUSIVE"
    assert cli(tool, "compare", *args, "--atol", "0.1", "--rtol", "0.1", "--accept-vacuous") == 0
    assert cli(tool, "compare", *args) == 1
    out = capsys.readouterr().out
    assert "x RMS(ref)" in out and f"Inputs:    --loadInputs {d / 'heldout.npz'}" in out


def test_synthetic_inputs_are_flagged_and_described(int8_text, capsys):
    d, _ = int8_text
    cli(tool, "compare", str(d / "text.onnx"), str(d / "text_int8.kiln"), "--no-histogram")
    out = capsys.readouterr().out
    assert "Inputs: SYNTHETIC, not data" in out and "(on synthetic inputs)" in out
    assert "input_ids: token ids uniform over 0..999 (the rows of embedding" in out
    assert "attention_mask: a mask" in out and "calibrated on data" in out
    cli(tool, "compare", str(d / "text.onnx"), str(d / "text_int8.kiln"), "--valRange", "input_ids:0,9")
    assert "input_ids: uniform in [0, 9] (--valRange)" in capsys.readouterr().out


def test_calibration_data_is_preferred_to_synthetic_inputs(int8_text, tmp_path, capsys):
    """`kiln build --calib` records the data; compare then runs on it and says so."""
    from kiln.cli import main

    d, _ = int8_text
    eng = tmp_path / "cal.kiln"
    assert main(["build", f"--onnx={d / 'text.onnx'}", "--int8", f"--calib={d / 'calib.npz'}", "--device=cpu",
                 f"--minShapes=input_ids:1x{SEQ},attention_mask:1x{SEQ}",
                 f"--optShapes=input_ids:8x{SEQ},attention_mask:8x{SEQ}",
                 f"--maxShapes=input_ids:64x{SEQ},attention_mask:64x{SEQ}",
                 f"--saveEngine={eng}", "--skipInference"]) == 0
    capsys.readouterr()
    cli(tool, "compare", str(d / "text.onnx"), str(eng), "--no-histogram")
    out = capsys.readouterr().out
    assert f"Inputs:    calibration data {(d / 'calib.npz').resolve()}" in out and "SYNTHETIC" not in out


def test_vacuity_is_measured_against_the_outputs_spread():
    ref = np.array([10.0, 10.2, 10.5])
    assert vacuous(ref, 0.0, 0.1)[0]  # rtol 10% of ~10 covers a spread of 0.5
    assert not vacuous(ref, 0.0, 0.01)[0]
    assert vacuous(ref, 0.25, 0.0) == (True, 10.25) and not vacuous(ref, 0.2, 0.0)[0]
    assert not vacuous(np.full(4, 3.0), 1.0, 1.0)[0]  # a constant reference: the check is exact, not vacuous
    r = compare_arrays("y", [ref], [ref + 0.01], 1.0, 0.0)
    assert r.mismatches == 0 and r.verdict == "INCONCLUSIVE" and not r.passed
    assert compare_arrays("y", [ref], [ref + 0.01], 1.0, 0.0, accept_vacuous=True).passed


def test_integer_outputs_compare_exactly(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ArgMax", ["y"], ["k"], axis=1, keepdims=0)],
        "argmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("k", TensorProto.INT64, ["n"])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    engine = kiln.build(model, kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (8, 8))})],
                                                fp16=True, **CPU))
    res = compare(model, engine)
    y, k = res.outputs
    assert (y.rtol, y.atol_basis.startswith("0.01 x RMS")) == (0.01, True)
    assert (k.atol, k.rtol, k.atol_basis) == (0.0, 0.0, "") and k.verdict == "PASSED"
