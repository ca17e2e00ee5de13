"""kiln/samples.py: the one loader of input samples (kiln run, compare, bench, report and calibration read theirs
through it), and kiln/json_file.py's JSON of results."""

import json

import numpy as np
import pytest
import torch

from kiln.errors import InputError
from kiln.json_file import atomic_write_json, to_json_text
from kiln.samples import load_samples


def test_every_file_form_gives_the_same_sample(tmp_path):
    x, m = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.int64)
    np.savez(tmp_path / "one.npz", x=x, mask=m, labels=np.zeros(2))
    (tmp_path / "folder").mkdir()
    np.savez(tmp_path / "folder" / "a.npz", x=x, mask=m)
    np.savez(tmp_path / "folder" / "b.npz", x=x + 1, mask=m)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "mask.npy", m)
    names = ["x", "mask"]
    for spec in (tmp_path / "one.npz", str(tmp_path / "one.npz"), f"x:{tmp_path / 'x.npy'},mask:{tmp_path / 'mask.npy'}"):
        (s,) = load_samples(spec, names)
        assert sorted(s) == ["mask", "x"] and np.array_equal(s["x"], x)  # labels dropped
    _, b = load_samples(tmp_path / "folder", names)
    assert np.array_equal(b["x"], x + 1)  # in name order
    (only,) = load_samples(str(tmp_path / "x.npy"), ["x"])  # a bare .npy for a one-input model
    assert np.array_equal(only["x"], x)
    with pytest.raises(InputError, match="fits a model with one input"):
        load_samples(str(tmp_path / "x.npy"), names)
    with pytest.raises(InputError, match=r"inputs \['mask'\] are missing"):
        load_samples(f"x:{tmp_path / 'x.npy'}", names)
    with pytest.raises(InputError, match="does not exist"):
        load_samples(str(tmp_path / "missing.npz"), names)


def test_samples_in_memory_are_taken_as_given():
    x = np.zeros((1, 3), np.float32)
    assert load_samples({"x": x}, ["x"])[0]["x"] is x
    assert load_samples(torch.zeros(2), ["x"])[0]["x"].shape == (2,)
    assert len(load_samples(iter([{"x": x}, {"x": x}]), ["x"])) == 2
    with pytest.raises(InputError, match="item 1 is a list"):
        load_samples([{"x": x}, [x]], ["x"])
    with pytest.raises(InputError, match="not a int"):
        load_samples(3, ["x"])


def test_results_json_converts_numpy_and_torch_values_and_writes_nan_as_a_string(tmp_path):
    obj = {"n": np.int64(3), "f": np.float32(0.5), "a": np.arange(2), "dtype": torch.float16, "bad": float("nan"),
           "big": [float("inf"), -float("inf")]}
    assert json.loads(to_json_text(obj)) == {"n": 3, "f": 0.5, "a": [0, 1], "dtype": "torch.float16", "bad": "NaN",
                                             "big": ["Infinity", "-Infinity"]}
    atomic_write_json(tmp_path / "r.json", obj)
    assert json.loads((tmp_path / "r.json").read_text())["bad"] == "NaN"
