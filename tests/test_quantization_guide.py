"""docs/quantization.md runs as written: its shell and Python blocks, in order, in one bash script on the CPU
(the guide's digits CNN trains in seconds). A guide whose commands stopped working fails here."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "quantization.md"


def _script(markdown: str) -> str:
    """The guide's fenced blocks as one bash script: shell blocks as they are, Python blocks through `python -`."""
    lines = ["set -euo pipefail", f'kiln() {{ "{sys.executable}" -m kiln "$@"; }}',
             f'python() {{ "{sys.executable}" "$@"; }}']
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", markdown, flags=re.S):
        lines.append(f"python - <<'PY'\n{body}PY" if lang == "python" else body)
    return "\n".join(lines) + "\n"


def test_the_quantization_guide_runs_as_written(tmp_path):
    script = _script(GUIDE.read_text())
    assert script.count("kiln build") >= 5 and "qat.prepare" in script and "quantize_static" in script
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU target, as CI has it, on any machine
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    q = tmp_path / "q"
    for made in ("digits_int8.kiln", "digits.calib.json", "digits_budget.kiln", "digits_qdq.kiln", "digits_qat.kiln",
                 "digits_kiln_qdq.onnx", "digits_int8.report.md"):
        assert (q / made).is_file(), made
    assert "3 INT8 layers" in run.stdout  # onnxruntime's quantized model: every weight layer on int8
