"""scripts/results-table prints one markdown table with a row from every results source it reads, each row
linking a committed file under bench/results/."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "results-table"
RESULTS = ROOT / "bench" / "results"


def _rows(*args):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0] == "| model | precision | batch | Kiln vs baseline | accuracy | file (measured) |"
    assert set(lines[1]) <= {"|", "-"}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert rows and all(len(r) == 6 for r in rows), out
    return rows


def test_a_row_per_source_and_every_link_resolves():
    rows = _rows()
    files = {re.match(r"\[`([^`]+)`\]\(([^)]+)\)", r[5]).group(2) for r in rows}
    assert all((ROOT / f).is_file() for f in files), files
    text = "\n".join(" | ".join(r) for r in rows)
    assert re.search(r"FP16 \| 1 / 32 \| [\d.]+x / [\d.]+x of torch.compile's time", text)
    assert re.search(r"(INT8|FP8) \| \d+ \| [\d.]+x of Kiln FP16's time", text)
    if (RESULTS / "H200-zoo.json").exists():
        assert "model zoo" in text
    if (RESULTS / "H200-llm.json").exists():
        assert "the tokens/s of HF transformers generate" in text
    if (RESULTS / "H200-llm-attention.md").exists():
        assert re.search(r"paged attention decode.*\d+% of the read bandwidth", text)


def test_link_prefix_for_pages_under_docs():
    rows = _rows("--link-prefix", "../")
    for r in rows:
        target = re.match(r"\[`[^`]+`\]\(([^)]+)\)", r[5]).group(1)
        assert (ROOT / "docs" / target).is_file(), target
