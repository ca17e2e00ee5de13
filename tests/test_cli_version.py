"""kiln --version names what an engine is stamped with; kiln run --json writes the timing summary."""

import json
import subprocess
import sys

import torch

from kiln import __version__
from kiln.cli import main


def test_version_names_kiln_torch_triton_cuda_and_the_gpu():
    done = subprocess.run([sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"Kiln {__version__}" and lines[1] == f"torch {torch.__version__}"
    assert lines[2].startswith("Triton ") and lines[3].startswith("CUDA ") and lines[4].startswith("GPU ")
    if not torch.cuda.is_available():
        assert "none found" in lines[4]


def test_run_json_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["build", "--device=cpu", "--iterations=2", "--json", "summary.json"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["synthetic_inputs"] is True and summary["timing"]["iterations"] >= 2
    assert summary["inputs"] and summary["layers"] > 0
