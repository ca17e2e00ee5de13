"""kiln verify: the task-metric gate on the digits CNN (trained here, held-out split)."""

import json

import numpy as np
import pytest

from kiln.errors import ConfigError, InputError, ShapeError
from kiln.examples import digits as digits_example
from kiln.tools import verify as tool
from kiln.tools.verify import verify

from .conftest import DIGITS_PROFILE, build, cli


def test_fp32_and_fp16_engines_pass_the_gate(digits, capsys, tmp_path):
    for engine in (digits.fp32, digits.fp16):
        rc = cli(tool, "verify", str(engine), "--data", str(digits.ex.data_path), "--reference",
                 str(digits.ex.onnx_path), "--metric", "top1,top5", "--budget", "top1=0.5", "--json",
                 str(tmp_path / "v.json"))
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "PASSED | every metric is within its budget" in out
        res = json.loads((tmp_path / "v.json").read_text())
        top1 = next(m for m in res["metrics"] if m["name"] == "top1")
        assert res["samples"] == digits.ex.samples == 360 and res["chunk"] == 128
        assert top1["reference"] == pytest.approx(digits.ex.test_accuracy)  # onnxruntime == PyTorch on held-out
        assert top1["reference"] > 90 and top1["passed"] and top1["drop"] <= 0.5
        assert res["agreement"] > 99


def test_an_engine_that_lost_accuracy_fails_its_budget(digits, tmp_path, capsys):
    # an engine built from an untrained network: same bindings, chance-level accuracy
    broken = tmp_path / "untrained.kiln"
    build(digits_example.onnx_model(digits_example.model(seed=1), "onnx"), DIGITS_PROFILE).save(broken)
    rc = cli(tool, "verify", str(broken), "--data", str(digits.ex.data_path), "--reference",
             str(digits.ex.onnx_path), "--budget", "top1=0.5")
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED | top1: the engine is" in out and "points below the reference, over the budget of 0.5 points" in out


def test_labels_and_data_problems_are_named(digits, tmp_path):
    z = np.load(digits.ex.data_path)
    x, y = z["image"], z["labels"]
    np.savez(tmp_path / "short.npz", image=x, labels=y[:100])
    with pytest.raises(InputError, match="'labels' has 100 entries but the inputs hold 360 samples"):
        verify(digits.fp32, tmp_path / "short.npz")
    np.savez(tmp_path / "nolabels.npz", image=x)
    with pytest.raises(InputError, match="has no 'labels' array"):
        verify(digits.fp32, tmp_path / "nolabels.npz")
    np.savez(tmp_path / "range.npz", image=x, labels=y + 5)
    with pytest.raises(InputError, match=r"outside 0..9: the output has 10 classes"):
        verify(digits.fp32, tmp_path / "range.npz")
    np.savez(tmp_path / "big.npz", image=np.zeros((4, 1, 16, 16), np.float32), labels=np.zeros(4, np.int64))
    with pytest.raises(ShapeError, match=r"input 'image' axis 2 is 16 in the data, outside profile 0's range \[8, 8\]"):
        verify(digits.fp32, tmp_path / "big.npz")
    with pytest.raises(ConfigError, match="unknown metric 'top3'"):
        cli(tool, "verify", str(digits.fp32), "--data", str(digits.ex.data_path), "--metric", "top3")
    with pytest.raises(ConfigError, match="--budget needs|give --reference"):
        verify(digits.fp32, digits.ex.data_path, budgets={"top1": 0.5})
    with pytest.raises(ConfigError, match="METRIC=POINTS"):
        cli(tool, "verify", str(digits.fp32), "--data", str(digits.ex.data_path), "--budget", "top1")


def test_custom_metric_callable_and_small_chunks(digits, tmp_path, monkeypatch):
    (tmp_path / "my_metrics.py").write_text(
        "import numpy as np\n"
        "def error_rate(outputs, labels):\n"
        "    return float((outputs.argmax(1) != labels).mean())\n"
        "error_rate.higher_is_better = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = verify(digits.fp16, digits.ex.data_path, reference=digits.ex.onnx_path,
                 metrics=["my_metrics:error_rate", "top1"], budgets={"my_metrics:error_rate": 0.01}, batch=50)
    err, top1 = res.metrics
    assert res.chunk == 50 and res.passed
    assert err.engine == pytest.approx(1 - top1.engine / 100) and not err.higher_is_better
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        verify(digits.fp16, digits.ex.data_path, metrics=["no_such_module:f"])


def test_last_chunk_is_padded_to_the_profile_minimum():
    seen = []

    def fn(feeds):
        seen.append(len(feeds["x"]))
        return {"y": feeds["x"] * 2}

    x = np.arange(10, dtype=np.float32)[:, None]
    out = tool.run_in_chunks(fn, {"x": x}, chunk=4, min_batch=3, names=["y"])["y"]
    assert seen == [4, 4, 3] and np.array_equal(out, x * 2)
