"""kiln compare --runners: several backends on the same inputs, Polygraphy's JSON in and out."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from kiln import cli
from kiln.errors import ConfigError, InputError
from kiln.frontend import from_torch
from kiln.tools import polygraphy_json


def make_mlp() -> torch.nn.Module:
    """The module the ONNX file below was exported from (the 'torch' runner's MODULE:FACTORY)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()


@pytest.fixture(scope="module")
def mlp_onnx(tmp_path_factory):
    import onnx

    model, _ = from_torch(make_mlp(), (torch.randn(4, 16),), input_names=["x"], output_names=["y"])
    path = tmp_path_factory.mktemp("runners") / "mlp.onnx"
    onnx.save(model, str(path))
    return path


def test_four_runners_one_table_and_polygraphy_files(mlp_onnx, tmp_path, capsys):
    inputs, outputs, report = tmp_path / "inputs.json", tmp_path / "outputs.json", tmp_path / "r.json"
    rc = cli.main(["compare", str(mlp_onnx), "--runners", "kiln-fp32,kiln-fp16,kiln-int8,onnxruntime,torch",
                   "--torch", "tests.tools.test_runners:make_mlp", "--samples", "2", "--device", "cpu",
                   "--save-inputs", str(inputs), "--save-outputs", str(outputs), "--json", str(report)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "SYNTHETIC" in text and "kiln-int8: scales calibrated on the 2 compared input sample(s)" in text
    res = json.loads(report.read_text())
    assert res["reference_runner"] == "onnxruntime" and res["verdict"] == "PASSED"
    assert {(r["runner"], r["output"]) for r in res["rows"]} == {(k, "y") for k in
                                                                ("kiln-fp32", "kiln-fp16", "kiln-int8", "torch")}
    # the INT8 engine differs from onnxruntime by more than the FP32 one, and both are measured
    err = {r["runner"]: r["max_abs"] for r in res["rows"]}
    assert 0 < err["kiln-fp32"] < err["kiln-int8"]
    # Polygraphy's shapes: a list of feed dicts; a RunResults keyed by runner name
    feeds = polygraphy_json.load_inputs(inputs, ["x"])
    assert len(feeds) == 2 and feeds[0]["x"].shape == (4, 16)
    raw = json.loads(outputs.read_text())
    assert raw["polygraphy_class"] == "RunResults"
    assert raw["lst"][0][1][0]["polygraphy_class"] == "IterationResult"
    runs = polygraphy_json.load_outputs(outputs)
    assert list(runs) == ["kiln-fp32", "kiln-fp16", "kiln-int8", "onnxruntime", "torch"]
    with torch.no_grad():
        want = make_mlp()(torch.from_numpy(feeds[1]["x"])).numpy()
    np.testing.assert_allclose(runs["torch"][1]["y"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(runs["onnxruntime"][1]["y"], want, rtol=1e-4, atol=1e-5)


def test_load_inputs_round_trip_and_engine_mode(mlp_onnx, tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    inputs = tmp_path / "in.json"
    polygraphy_json.save_inputs(inputs, [{"x": x}])
    report = tmp_path / "r.json"
    rc = cli.main(["compare", str(mlp_onnx), "--runners", "onnxruntime,kiln-fp32", "--load-inputs", str(inputs),
                   "--device", "cpu", "--json", str(report), "--save-outputs", str(tmp_path / "o.json")])
    assert rc == 0, capsys.readouterr()
    res = json.loads(report.read_text())
    assert res["inputs"] == f"--loadInputs {inputs}" and res["samples"] == 1
    got = polygraphy_json.load_outputs(tmp_path / "o.json")["kiln-fp32"][0]["y"]
    assert got.shape == (4, 8)
    # the one-engine compare reads and writes the same files
    engine = tmp_path / "mlp.kiln"
    assert cli.main(["build", f"--onnx={mlp_onnx}", "--shapes=x:4x16", f"--saveEngine={engine}",
                     "--skipInference", "--device", "cpu"]) == 0
    out2 = tmp_path / "o2.json"
    assert cli.main(["compare", str(mlp_onnx), str(engine), "--loadInputs", str(inputs), "--device", "cpu",
                     "--save-outputs", str(out2)]) == 0
    runs = polygraphy_json.load_outputs(out2)
    assert set(runs) == {"kiln", "onnxruntime"}
    np.testing.assert_allclose(runs["kiln"][0]["y"], got, rtol=1e-5, atol=1e-6)


def test_polygraphy_reads_our_files(mlp_onnx, tmp_path):
    pytest.importorskip("polygraphy", reason="Polygraphy is not installed here: its own reader is not checked")
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    polygraphy_json.save_inputs(tmp_path / "in.json", [{"x": x}])
    np.testing.assert_array_equal(load_json(str(tmp_path / "in.json"))[0]["x"], x)
    polygraphy_json.save_outputs(tmp_path / "out.json", {"kiln-fp32": [{"y": x * 2}]}, {"kiln-fp32": [0.5]})
    rr = RunResults.load(str(tmp_path / "out.json"))
    name, its = rr[0]
    assert name == "kiln-fp32"
    np.testing.assert_array_equal(np.asarray(its[0]["y"]), x * 2)


def test_runner_errors(mlp_onnx, tmp_path, capsys):
    assert cli.main(["compare", str(mlp_onnx), "--runners", "kiln-fp16,tensorrt"]) == ConfigError.exit_code
    assert "'tensorrt'" in capsys.readouterr().err
    assert cli.main(["compare", str(mlp_onnx), "--runners", "onnxruntime,torch"]) == ConfigError.exit_code
    assert "--torch MODULE:FACTORY" in capsys.readouterr().err
    assert cli.main(["compare", str(mlp_onnx), "x.kiln", "--runners", "onnxruntime,kiln-fp32"]) == 2
    assert "leave out ENGINE" in capsys.readouterr().err
    assert cli.main(["compare", str(mlp_onnx)]) == 2
    assert "--runners" in capsys.readouterr().err
    # a torch.save payload (a pickle) is refused, not loaded
    buf = io.BytesIO()
    torch.save(torch.zeros(2), buf)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"x": {"tensor": base64.b64encode(buf.getvalue()).decode(),
                                      "polygraphy_class": "Tensor"}}]))
    with pytest.raises(InputError, match="does not unpickle"):
        polygraphy_json.load_inputs(bad, ["x"])
    with pytest.raises(InputError, match="missing"):
        polygraphy_json.load_inputs(bad, ["x", "mask"])
