"""The `kiln` command end to end (CPU target): build, run, and user errors without tracebacks."""

import subprocess
import sys

import numpy as np
import pytest

from kiln.cli import main

from .models import mlp, mlp_reference


def kiln_cmd(*args, cwd=None):
    """Run the real console entry point in a subprocess (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_build_default_model_on_cpu_says_so(tmp_path):
    code, out, err = kiln_cmd("build", "--saveEngine=tiny.kiln", "--iterations=5", "--warmUp=10", cwd=tmp_path)
    assert code == 0, err
    assert "building for the CPU target" in err
    assert "Built Kiln's embedded tiny CNN" in out and "Throughput:" in out and "Latency: min =" in out
    assert (tmp_path / "tiny.kiln").stat().st_size > 0


def test_build_then_run_engine_with_inputs_and_exported_outputs(tmp_path, capsys):
    model_path = tmp_path / "mlp.onnx"
    model_path.write_bytes(mlp().SerializeToString())
    engine = tmp_path / "mlp.kiln"
    assert main(["build", f"--onnx={model_path}", f"--saveEngine={engine}", "--minShapes=x:1x8",
                 "--optShapes=x:4x8", "--maxShapes=x:16x8", "--skipInference", "--device=cpu"]) == 0
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    out_file = tmp_path / "out.npz"
    assert main(["run", f"--loadEngine={engine}", f"--loadInputs={tmp_path / 'in.npz'}",
                 f"--exportOutput={out_file}", "--iterations=3", "--warmUp=1"]) == 0
    with np.load(out_file) as z:
        np.testing.assert_allclose(z["y"], mlp_reference(mlp(), x), rtol=1e-5, atol=1e-5)
    assert "percentile(99%)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["run", "--loadEngine=missing.kiln"], "does not exist"),
    (["build", "--onnx=garbage.onnx"], "garbage.onnx"),
    (["build", "--minShapes=x:1x8", "--minShapes=x:2x8", "--optShapes=x:4x8"], "same number of times"),
    (["build", "--memPoolSize=lots"], "workspace:4096"),
])
def test_user_errors_are_one_paragraph_without_traceback(tmp_path, args, message):
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\x07not a protobuf at all")
    code, out, err = kiln_cmd(*args, cwd=tmp_path)
    assert code != 0
    assert "Traceback" not in err and message in err


def test_shape_outside_profile_is_refused(tmp_path):
    model_path = tmp_path / "mlp.onnx"
    model_path.write_bytes(mlp().SerializeToString())
    code, _, err = kiln_cmd("run", f"--onnx={model_path}", "--minShapes=x:1x8", "--optShapes=x:2x8",
                            "--maxShapes=x:4x8", "--shapes=x:9x8", "--device=cpu", cwd=tmp_path)
    assert code != 0 and "input 'x' axis 0 is 9" in err and "[1, 4]" in err and "Traceback" not in err


def test_shapes_alone_is_the_build_profile_as_in_trtexec(tmp_path):
    """A dynamic model given only --shapes builds for exactly those shapes and runs them."""
    model_path = tmp_path / "mlp.onnx"
    model_path.write_bytes(mlp().SerializeToString())
    code, out, err = kiln_cmd("build", f"--onnx={model_path}", "--shapes=x:6x8", "--device=cpu",
                              "--iterations=2", cwd=tmp_path)
    assert code == 0, err
    assert "x: 6x8..6x8 (opt 6x8)" in out and "no profile covers them" not in err


def test_best_builds_fp16_without_calibration_and_int8_with_it(tmp_path):
    """trtexec's --best: every precision that can be made accurate. Without calibration data Kiln builds FP16
    and says why it did not quantize; with it, the GEMMs run on INT8."""
    import kiln

    model_path = tmp_path / "mlp.onnx"
    model_path.write_bytes(mlp().SerializeToString())
    shapes = ["--minShapes=x:1x8", "--optShapes=x:4x8", "--maxShapes=x:16x8"]
    code, _, err = kiln_cmd("build", f"--onnx={model_path}", "--best", "--saveEngine=fp16.kiln", "--skipInference",
                            "--device=cpu", *shapes, cwd=tmp_path)
    assert code == 0, err
    assert "--best without calibration data builds FP16" in err
    assert kiln.load(str(tmp_path / "fp16.kiln")).build_config["precision"] == "float16"
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32))
    code, _, err = kiln_cmd("build", f"--onnx={model_path}", "--best", f"--calib={tmp_path / 'calib.npz'}",
                            "--saveEngine=int8.kiln", "--skipInference", "--device=cpu", *shapes, cwd=tmp_path)
    assert code == 0, err
    engine = kiln.load(str(tmp_path / "int8.kiln"))
    assert engine.build_config["int8"] and sum(n.op_type == "QGemm" for n in engine.graph.nodes) == 2


def test_exclude_tactics_is_recorded_and_a_misspelt_one_refused(tmp_path):
    import kiln

    code, _, err = kiln_cmd("build", "--excludeTactics=triton_tma_*, cudnn_conv_relu", "--saveEngine=e.kiln",
                            "--skipInference", cwd=tmp_path)
    assert code == 0, err
    assert kiln.load(str(tmp_path / "e.kiln")).build_config["exclude_tactics"] == ["triton_tma_*", "cudnn_conv_relu"]
    code, out, err = kiln_cmd("build", "--excludeTactics=cudnn_conv_rleu", "--saveEngine=f.kiln", cwd=tmp_path)
    assert code != 0 and "'cudnn_conv_rleu' matches no tactic" in err and "cudnn_conv_relu" in err
    assert "Traceback" not in err and not (tmp_path / "f.kiln").exists()
