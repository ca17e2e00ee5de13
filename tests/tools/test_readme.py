"""The README's Python block runs as shown (a fresh interpreter, in an empty directory, on whatever target
this machine has: the CPU target in CI)."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_python_block_runs_as_shown(tmp_path):
    blocks = python_blocks()
    assert blocks, "README.md has no ```python block"
    for code in blocks:
        assert 'device="cuda"' not in code  # runs on the CPU target as well
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "model.kiln").exists()
