"""kiln inspect: per-layer rows, TensorRT layer-info JSON, findings."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.errors import EngineFileError
from kiln.tools import inspect as tool
from kiln.tools.inspect import inspect_engine

from .conftest import build, cli


def test_rows_shapes_per_profile_and_trt_json(mlp_files, capsys, tmp_path):
    rc = cli(tool, "inspect", str(mlp_files.fp16), "--json", str(tmp_path / "layers.json"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "fc1 + fc1_bias + relu" in out and "x [1..16]x8" in out and "h2 [1..16]x16" in out
    with open(tmp_path / "layers.json") as f:
        info = json.load(f)
    assert set(info) >= {"Layers", "Bindings"} and info["Bindings"] == ["x", "y"]
    first = info["Layers"][0]
    for key in ("Name", "LayerType", "Inputs", "Outputs", "TacticName"):
        assert key in first
    assert first["Name"] == "fc1 + fc1_bias + relu" and first["Sources"] == ["fc1", "fc1_bias", "relu"]
    x = first["Inputs"][0]
    assert x["Name"] == "x" and x["Dimensions"] == [4, 8] and x["Format/Datatype"] == "Row major linear FP32"
    assert x["Profiles"] == [{"min": [1, 8], "opt": [4, 8], "max": [16, 8]}]
    h2 = first["Outputs"][0]
    assert h2["Format/Datatype"] == "Row major linear FP16" and h2["Profiles"][0]["max"] == [16, 16]
    assert first["Weights"] == {"Type": "Half", "Count": 8 * 16 + 16}
    assert first["ActivationBytes"] == [16 * 16 * 2]  # h2 at max batch, fp16
    assert info["Kiln"]["precision"] == "float16" and info["Kiln"]["findings"] == []


def test_two_profiles_get_their_own_shapes():
    import kiln

    from ..models import mlp

    eng = kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, profiles=[
        kiln.Profile({"x": ((1, 8), (2, 8), (4, 8))}), kiln.Profile({"x": ((8, 8), (16, 8), (32, 8))})]))
    y = inspect_engine(eng).layers[-1].outputs[0]
    assert y.shapes == [{"min": [1, 4], "opt": [2, 4], "max": [4, 4]}, {"min": [8, 4], "opt": [16, 4], "max": [32, 4]}]
    assert tool.compact_range(y.shapes) == "[1..4]x4 | [8..32]x4"


def _reduce_and_shared_conv() -> onnx.ModelProto:
    """A Conv whose output has two readers (Conv+Relu cannot fuse) and a ReduceSum (kept FP32 in FP16)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Add", ["c", "r"], ["s"], name="add"),
        helper.make_node("ReduceSum", ["s", "axes"], ["y"], name="sum", keepdims=0),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w, axes])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_findings_missed_fusion_and_higher_precision(capsys):
    eng = build(_reduce_and_shared_conv(), {"x": ((1, 3, 8, 8), (2, 3, 8, 8), (2, 3, 8, 8))}, fp16=True)
    ins = inspect_engine(eng, measure=False)
    kinds = {f["kind"] for f in ins.findings}
    assert kinds == {"fusion-missed", "precision"}
    missed = next(f for f in ins.findings if f["kind"] == "fusion-missed")
    assert missed["pattern"] == "Conv + activation" and "conv" in missed["nodes"] and "readers" in missed["reason"]
    prec = next(f for f in ins.findings if f["kind"] == "precision")
    assert prec["layer"] == "sum" and prec["actual"] == "float32" and prec["requested"] == "float16"
    tool.render(ins, __import__("kiln.console", fromlist=["console"]).console())
    out = capsys.readouterr().out
    assert "fusion not applied: Conv + activation on 'conv'" in out
    assert "layer 'sum' runs in float32, the build requested float16" in out


def test_engine_for_another_gpu_is_inspected_from_its_manifest(mlp_files, tmp_path, capsys):
    from ..engine.util import rewrite_manifest

    path = tmp_path / "h200.kiln"
    shutil.copy(mlp_files.fp16, path)
    rewrite_manifest(path, lambda m: m.update(target={"kind": "cuda", "name": "NVIDIA H200", "capability": "9.0"}))
    assert cli(tool, "inspect", str(path)) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (compute capability 9.0)" in out and "cannot run here" in out
    assert "fc1 + fc1_bias + relu" in out
    (tmp_path / "junk.kiln").write_bytes(b"not a zip")
    with pytest.raises(EngineFileError, match="not a Kiln engine"):
        cli(tool, "inspect", str(tmp_path / "junk.kiln"))
