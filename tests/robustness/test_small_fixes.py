"""Small refusals: the flag named in a shape error, `python -m kiln`'s import path, complex runtime inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.errors import ConfigError, InputError

from ..models import mlp

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_shapes_flag_is_named_as_given():
    from kiln.engine.profile import profile_from_flags

    with pytest.raises(ConfigError, match=r"^--shapes for input 'x': '-3x8'"):
        profile_from_flags("x:-3x8", "x:-3x8", "x:-3x8", ("--shapes",) * 3)
    with pytest.raises(ConfigError, match=r"^--minShapes for input 'x'"):
        profile_from_flags("x:-3x8", "", "")


def test_kiln_build_shapes_flag_error_names_shapes(tmp_path, capsys):
    from kiln.cli import main

    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(mlp().SerializeToString())
    assert main(["build", f"--onnx={onnx_path}", "--device=cpu", "--shapes=x:-3x8", "--skipInference"]) != 0
    err = capsys.readouterr().err
    assert "--shapes for input 'x': '-3x8' has a negative dimension" in err and "--minShapes" not in err, err


def test_python_m_kiln_does_not_import_from_the_working_folder(tmp_path):
    (tmp_path / "cwd_model.py").write_text("raise SystemExit('cwd_model.py was imported from the working folder')\n")
    engine = kiln.build(mlp(), kiln.BuildConfig(shapes={"x": (2, 8)}, device="cpu", progress=False))
    engine.save(tmp_path / "e.kiln")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "kiln", "bench", "e.kiln", "--baseline=eager", "--torch=cwd_model:make"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in text, text[-2000:]
    assert "was imported from the working folder" not in text, text[-2000:]
    assert "cwd_model" in text, text[-2000:]


def test_a_complex_input_is_refused_by_name():
    engine = kiln.build(mlp(), kiln.BuildConfig(shapes={"x": (2, 8)}, device="cpu", progress=False))
    ctx = engine.create_execution_context()
    with pytest.raises(InputError, match=r"input 'x' is complex64 but the engine expects float32"):
        ctx.run({"x": np.zeros((2, 8), np.complex64)})
