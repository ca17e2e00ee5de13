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


def test_the_report_gives_each_call_s_own_host_time_where_the_run_recorded_it():
    run = json.loads(RESULT.read_text())
    report = to_markdown(run["environment"], run["results"])
    assert "the call's own host time" not in report  # the 09:51 run did not record it
    int8 = run["results"][0]["results"]["kiln_int8"]
    int8.update(host_us=21.4, gc_runs=3)
    report = to_markdown(run["environment"], run["results"])
    assert "the device waits 59 us for the host; the call's own host time 21 us, the garbage collector ran 3 times " \
           "in 100 timed calls" in report
