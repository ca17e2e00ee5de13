"""bench/run.py's report, rendered from a committed H200 result (bench/results/H200-quant-0951-resnet50.json)."""

import json
from pathlib import Path

from bench.run import to_markdown

RESULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "H200-quant-0951-resnet50.json"


def test_the_report_gives_the_8_bit_engines_against_fp16_per_call_and_with_the_host_hidden():
    run = json.loads(RESULT.read_text())
    report = to_markdown(run["environment"], run["results"])
    assert "| kiln_int8 | 0.77x | 0.73x |" in report  # 0.772 / 0.997 per call; 0.713 / 0.979 on the device
    assert "| kiln_fp8 | 0.78x | 0.74x |" in report
