"""check_model / `kiln check`: checker, strict shape inference, opsets, operator table, CLI."""

import argparse
import io
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from kiln.errors import ConfigError, ModelError
from kiln.frontend import check as check_mod
from kiln.frontend import check_model
from kiln.frontend.check import add_check_command
from kiln.ops import lookup

from .helpers import graph_model, mlp, save_external, vi

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _render(report) -> str:
    buf = io.StringIO()
    report.render(Console(file=buf, width=200, color_system=None))
    return buf.getvalue()


def _run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="kiln")
    add_check_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_buildable_model(fake_ops):
    r = check_model(mlp())
    assert r.buildable and r.problems == []
    assert r.checker.passed and r.shape_inference.passed
    assert [(i.name, i.dtype, i.shape, i.dynamic_axes) for i in r.inputs] == [("x", "float32", ["batch", 64], [0])]
    assert r.outputs[0].shape == ["batch", 64]
    assert {op.op_type: (op.count, op.supported) for op in r.operators} == {
        "MatMul": (1, True), "Add": (1, True), "Relu": (1, True)}
    assert any("'x'" in w and "dynamic axes [0]" in w for w in r.warnings)  # a profile will be needed
    j = r.to_json()
    assert json.loads(json.dumps(j)) == j  # plain JSON
    assert j["buildable"] is True and j["opsets"] == {"ai.onnx": 17} and j["opset"]["meets_recommendation"]
    assert j["inputs"][0] == {"name": "x", "dtype": "float32", "shape": ["batch", 64], "dynamic_axes": [0]}
    out = _render(r)
    assert "BUILDABLE" in out and "MatMul" in out and "batch x 64" in out


def test_unsupported_op_names_node(fake_ops):
    m = graph_model(
        [helper.make_node("Relu", ["x"], ["h"], name="relu"),
         helper.make_node("Frob", ["h"], ["y"], name="the_frob", domain="my.ops")],
        [vi("x", [2, 3])], [vi("y", [2, 3])], extra_opsets=[helper.make_opsetid("my.ops", 1)])
    r = check_model(m)
    assert not r.buildable
    row = next(op for op in r.operators if op.op_type == "Frob")
    assert row.domain == "my.ops" and not row.supported and row.blocking_nodes == ["the_frob"]
    assert row.restrictions == ["operator my.ops::Frob is not implemented"]
    assert r.blocking_nodes == ["the_frob"]
    assert any("the_frob" in p for p in r.problems)
    assert r.operators[0].op_type == "Frob"  # blockers first
    assert "NOT BUILDABLE" in _render(r)


def test_restriction_hit_and_partial_support(fake_ops):
    w = numpy_helper.from_array(np.ones((3, 3), np.float32), "w")
    m = graph_model(
        [helper.make_node("Gemm", ["x", "w"], ["h"], name="g_ok"),
         helper.make_node("Gemm", ["h", "w"], ["y"], name="g_transposed", transA=1)],
        [vi("x", [3, 3])], [vi("y", [3, 3])], [w])
    r = check_model(m)
    row = r.operators[0]
    assert (row.op_type, row.count, row.blocking_nodes) == ("Gemm", 2, ["g_transposed"])
    assert row.restrictions == ["Gemm with transA=1 is not supported"]
    assert row.status == "partial (1 of 2 blocked)"
    assert r.to_json()["operators"][0]["restrictions"] == ["Gemm with transA=1 is not supported"]


def test_op_older_than_supported_opset(fake_ops):
    m = graph_model([helper.make_node("Softmax", ["x"], ["y"], name="sm")], [vi("x", [2, 3])], [vi("y", [2, 3])],
                    opset=11)
    r = check_model(m)
    assert r.blocking_nodes == ["sm"] and "upgrade-opset" in r.operators[0].restrictions[0]
    assert any("opset 11" in w and "17" in w for w in r.warnings)


def test_subgraph_nodes_are_walked(fake_ops):
    then_g = helper.make_graph([helper.make_node("Frob", ["x"], ["t"], domain="my.ops")], "then", [], [vi("t", [2])])
    else_g = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="inner_relu")], "else", [], [vi("e", [2])])
    m = graph_model(
        [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)],
        [vi("c", [], TensorProto.BOOL), vi("x", [2])], [vi("y", [2])],
        extra_opsets=[helper.make_opsetid("my.ops", 1)])
    r = check_model(m)
    assert r.blocking_nodes == ["branch/then_branch/Frob_0"]  # unnamed: op_type_index, under its parent
    assert {op.op_type for op in r.operators} == {"If", "Frob", "Relu"}
    assert r.missing_inputs == []  # x comes from the outer scope


def test_missing_initializer_names_node(fake_ops):
    m = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [2, 4])], [vi("y", [2, 4])])
    r = check_model(m)
    assert not r.buildable
    assert [(mi.node, mi.input) for mi in r.missing_inputs] == [("mm", "w")]
    assert any("node 'mm' reads 'w'" in p for p in r.problems)
    assert not r.checker.passed and r.checker.node == "mm"
    assert r.to_json()["missing_inputs"] == [{"node": "mm", "input": "w"}]


def test_unproduced_graph_output(fake_ops):
    m = graph_model([helper.make_node("Relu", ["x"], ["h"], name="relu")], [vi("x", [2])], [vi("y", [2])])
    r = check_model(m)
    assert any("graph output 'y'" in p for p in r.problems)


def test_shape_inference_error_names_node(fake_ops):
    w = numpy_helper.from_array(np.ones((5, 4), np.float32), "w")
    m = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="bad_mm")], [vi("x", [2, 4])],
                    [vi("y", [2, 4])], [w])
    r = check_model(m)
    assert r.checker.passed  # structurally fine
    assert not r.shape_inference.passed and r.shape_inference.node == "bad_mm"
    assert "Incompatible dimensions" in r.shape_inference.message
    assert not r.buildable and any("at node 'bad_mm'" in p for p in r.problems)


def test_type_error_is_reported(fake_ops):
    w = numpy_helper.from_array(np.ones((4, 4), np.int64), "w")
    m = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mixed")], [vi("x", [2, 4])],
                    [vi("y", [2, 4])], [w])
    r = check_model(m)
    assert not r.shape_inference.passed and r.shape_inference.node == "mixed"


def test_unknown_op_fails_checker(fake_ops):
    m = graph_model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")], [vi("x", [2])], [vi("y", [2])])
    r = check_model(m)
    assert not r.checker.passed and r.checker.node == "frob"
    assert r.blocking_nodes == ["frob"]


def test_unsupported_types_and_string_initializers(fake_ops):
    s = helper.make_tensor("names", TensorProto.STRING, [1], [b"a"])
    m = graph_model([helper.make_node("Identity", ["x"], ["y"], name="id")],
                    [vi("x", [2], TensorProto.COMPLEX64)], [vi("y", [2], TensorProto.COMPLEX64)], [s])
    r = check_model(m)
    assert any("graph input 'x'" in p and "complex64" in p for p in r.problems)
    assert any("initializer 'names'" in p and "string" in p for p in r.problems)


def test_local_function_hint(fake_ops):
    f = helper.make_function("my.fn", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                             [helper.make_opsetid("", 17)])
    m = graph_model([helper.make_node("Twice", ["x"], ["y"], name="call", domain="my.fn")],
                    [vi("x", [2])], [vi("y", [2])], extra_opsets=[helper.make_opsetid("my.fn", 1)], functions=[f])
    r = check_model(m)
    assert r.checker.passed and r.shape_inference.passed
    assert r.blocking_nodes == ["call"] and "function defined in the model" in r.operators[0].restrictions[0]


def test_in_memory_model_is_not_modified(fake_ops):
    m = mlp(opset=13)
    before = m.SerializeToString()
    r = check_model(m, upgrade_opset=17)
    assert r.upgrade.ok and m.SerializeToString() == before


# --------------------------------------------------------------------------- opsets


def test_upgrade_opset_reports_changes(fake_ops):
    r = check_model(os.path.join(LIGHT, "light_squeezenet.onnx"), upgrade_opset=17)
    assert r.upgrade.ok and r.upgrade.source == 9 and r.opsets == {"": 17}
    changes = "\n".join(r.upgrade.changes)
    assert "ai.onnx opset 9 -> 17" in changes and "Softmax" in changes
    assert "IR version 3 -> 8" in changes and r.ir_version == 8
    assert not any("opset 9" in w for w in r.warnings)  # the checked model is the converted one
    assert r.checker.passed and r.shape_inference.passed
    assert r.to_json()["opset"]["upgrade"]["ok"] is True


def test_upgrade_failure_is_reported(fake_ops):
    r = check_model(mlp(opset=17), upgrade_opset=13)
    assert not r.upgrade.ok and "downgrade" in r.upgrade.error
    r = check_model(mlp(opset=17), upgrade_opset=999)
    assert not r.upgrade.ok and "not a valid target" in r.upgrade.error
    frob = graph_model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")], [vi("x", [2])], [vi("y", [2])],
                       opset=11)
    r = check_model(frob, upgrade_opset=17)
    assert not r.upgrade.ok and "'frob' (Frobnicate)" in r.upgrade.error
    r = check_model(os.path.join(LIGHT, "light_squeezenet.onnx"), upgrade_opset=9)
    assert r.upgrade.ok and "nothing to convert" in r.upgrade.changes[0]


def test_converter_error_is_cleaned(fake_ops):
    res = check_mod.convert_opset(onnx.load(os.path.join(LIGHT, "light_squeezenet.onnx")), 8)
    assert not res.ok and "downgrade" in res.error
    from kiln.frontend.opset import _clean
    raw = ("/project/onnx/version_converter/adapters/no_previous_version.h:23: adapt: Assertion `false` failed: "
           "No Previous Version of ConstantOfShape exists")
    assert _clean(raw) == "No Previous Version of ConstantOfShape exists"


# --------------------------------------------------------------------------- external data / large models


def test_external_data_model_is_checked_through_its_path(fake_ops, tmp_path, monkeypatch):
    """Models over 2 GB keep weights external; onnx must then be given the path, never the proto."""
    path = save_external(mlp(), tmp_path)
    seen = {}
    real_check, real_infer = onnx.checker.check_model, onnx.shape_inference.infer_shapes_path

    def spy_check(model, *a, **k):
        seen["checker"] = model
        return real_check(model, *a, **k)

    def spy_infer(src, dst, *a, **k):
        seen["infer"] = (src, a, k)
        return real_infer(src, dst, *a, **k)

    monkeypatch.setattr(onnx.checker, "check_model", spy_check)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes_path", spy_infer)
    r = check_model(path)
    assert seen["checker"] == str(path)
    assert (seen["infer"][0] == str(path)
            and seen["infer"][2] == {"check_type": True, "strict_mode": True, "data_prop": True})
    assert r.buildable and r.checker.passed and r.shape_inference.passed
    assert r.outputs[0].shape == ["batch", 64]


def test_bad_external_data_is_a_load_error(fake_ops, tmp_path):
    path = save_external(mlp(), tmp_path)
    (tmp_path / "model.data").unlink()
    with pytest.raises(ModelError, match="initializer 'w'.*does not exist"):
        check_model(path)


def test_huge_in_memory_model_is_saved_for_path_checks(fake_ops, monkeypatch):
    """An in-memory model protobuf cannot serialize (over 2 GB) is written to a temporary folder first."""
    monkeypatch.setattr(check_mod, "_too_big", lambda model: True)
    seen = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (seen.append(m), real_check(m, *a, **k))[1])
    m = mlp()
    before = m.SerializeToString()
    r = check_model(m)
    assert isinstance(seen[0], str) and seen[0].endswith("model.onnx")
    assert r.checker.passed and r.shape_inference.passed
    assert m.SerializeToString() == before  # weights moved out for the write, then put back


def test_upgrade_of_external_data_model(fake_ops, tmp_path, capsys):
    path = save_external(mlp(opset=13), tmp_path)
    out = tmp_path / "up" / "model17.onnx"
    code, text = _run_cli(["check", str(path), "--upgrade-opset", "17", "--output", str(out), "--json"], capsys)
    assert code == 0
    j = json.loads(text)
    assert j["opset"]["upgrade"]["ok"] and j["opset"]["upgrade"]["saved_to"] == str(out)
    assert (out.parent / "model17.onnx.data").exists()  # it kept its weights external
    from kiln.frontend import load_onnx
    m = load_onnx(out)
    assert m.opset_import[0].version == 17
    np.testing.assert_array_equal(numpy_helper.to_array(m.graph.initializer[0]),
                                  numpy_helper.to_array(mlp().graph.initializer[0]))
    with pytest.raises(ConfigError, match="would overwrite the model being read"):
        _run_cli(["check", str(path), "--upgrade-opset", "17", "--output", str(path)], capsys)


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes_and_json(fake_ops, tmp_path, capsys):
    good = tmp_path / "good.onnx"
    onnx.save_model(mlp(), str(good))
    code, out = _run_cli(["check", str(good)], capsys)
    assert code == 0 and "BUILDABLE" in out
    code, out = _run_cli(["check", str(good), "--json"], capsys)
    assert code == 0 and json.loads(out)["buildable"] is True

    bad = tmp_path / "bad.onnx"
    onnx.save_model(graph_model([helper.make_node("Frob", ["x"], ["y"], name="fb", domain="my.ops")],
                                [vi("x", [2])], [vi("y", [2])], extra_opsets=[helper.make_opsetid("my.ops", 1)]),
                    str(bad))
    code, out = _run_cli(["check", str(bad), "--json"], capsys)
    assert code == 1 and json.loads(out)["blocking_nodes"] == ["fb"]

    code, out = _run_cli(["check", str(good), "--upgrade-opset", "12"], capsys)  # a downgrade: refused
    assert code == 1 and "downgrade" in out

    code, out = _run_cli(["check", str(tmp_path / "nope.onnx"), "--json"], capsys)
    assert code == 2 and "does not exist" in json.loads(out)["error"]
    with pytest.raises(ModelError, match="nope.onnx"):
        _run_cli(["check", str(tmp_path / "nope.onnx")], capsys)
    with pytest.raises(ConfigError, match="--upgradeOpset"):
        _run_cli(["check", str(good), "--output", str(tmp_path / "x.onnx")], capsys)


def test_cli_writes_upgraded_model(fake_ops, tmp_path, capsys):
    out = tmp_path / "squeeze17.onnx"
    code, text = _run_cli(["check", os.path.join(LIGHT, "light_squeezenet.onnx"), "--upgrade-opset", "17",
                           "-o", str(out)], capsys)
    assert "written to" in text
    m = onnx.load(str(out))
    assert m.opset_import[0].version == 17 and m.ir_version == 8
    onnx.checker.check_model(m, full_check=True)


def test_real_registry_agrees():
    """With whatever ops are registered now, the table matches the registry (ops land in parallel)."""
    r = check_model(os.path.join(LIGHT, "light_resnet50.onnx"), upgrade_opset=17)
    assert r.upgrade.ok and r.checker.passed and r.shape_inference.passed
    for row in r.operators:
        if lookup(row.op_type, row.domain) is None:
            assert not row.supported and row.blocking_nodes
    assert r.buildable == all(row.supported for row in r.operators)
