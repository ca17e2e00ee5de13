"""kiln report: one self-contained HTML page (and markdown twin) answering the litmus tests."""

import json
import re
import xml.etree.ElementTree as ET

import pytest

from kiln.errors import ConfigError
from kiln.tools import report as tool
from kiln.tools.report import Request, build_report, coverage, load_traffic

from .conftest import cli


def test_digits_report_answers_the_litmus_tests(digits, tmp_path, capsys):
    traffic = tmp_path / "traffic.txt"
    traffic.write_text("# observed in production\nimage:1x1x8x8 500\nimage:32x1x8x8 120\n256 3\nimage:64x1x8x8\n")
    rc = cli(tool, "report", str(digits.fp16), "--latency-target", "1000", "--traffic", str(traffic),
             "--reference", str(digits.ex.onnx_path), "--data", str(digits.ex.data_path), "--budget", "top1=0.5",
             "--iterations", "5", "--warmUp", "1", "--profileIterations", "1", "--out", str(tmp_path / "r"),
             "--json", str(tmp_path / "r.json"))
    out = capsys.readouterr().out
    assert rc == 1  # batch 256 is outside the profile: a litmus test fails
    data = json.loads((tmp_path / "r.json").read_text())
    status = [x["status"] for x in data["litmus"]]
    assert status == ["warn", "fail", "pass", "pass"]  # latency: a CPU figure is not a GPU answer
    assert "3 of 624 requests would be rejected: image:256x1x8x8 (x3)" in out
    assert "a CPU measurement" in data["litmus"][0]["answer"]

    html = (tmp_path / "r.html").read_text()
    md = (tmp_path / "r.md").read_text()
    # self-contained: no scripts, no external resources, nothing fetched
    assert "<script" not in html.lower() and not re.search(r"\b(src|href)\s*=", html)
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    titles = [ET.fromstring(s).find("{http://www.w3.org/2000/svg}title").text for s in svgs]
    assert titles == ["Latency distribution", "Per-layer time (mean per run)", "Absolute error of 'logits'"]
    assert "target 1000 ms" in html and "outside [1, 128]" in html and "top1" in html
    for text in ("## Litmus tests", "## 1. Latency", "## 2. Profile coverage", "## 3. Accuracy",
                 "## 4. Inspector findings", "| **FAIL** |", "image:256x1x8x8"):
        assert text in md


def test_traffic_formats_and_coverage(digits, tmp_path):
    from kiln.engine.serialize import load

    eng = load(digits.fp32)
    j = tmp_path / "t.json"
    j.write_text(json.dumps([{"image": [4, 1, 8, 8], "count": 10}, "image:200x1x8x8", 4, {"batch": 129}]))
    reqs = load_traffic(j, eng)
    assert [(r.text, r.count) for r in reqs] == [("image:4x1x8x8", 11), ("image:200x1x8x8", 1),
                                                 ("image:129x1x8x8", 1)]
    profiles = [p.to_json() for p in eng.profiles]
    cov = coverage(profiles, reqs)
    assert cov["requests"] == 13 and cov["rejected_requests"] == 2
    assert [r["shape"] for r in cov["rejected"]] == ["image:200x1x8x8", "image:129x1x8x8"]
    assert coverage(profiles, [Request({"image": (2, 1, 8)})])["rows"][0]["reasons"] == {
        0: "'image' has rank 3, the engine expects 4"}
    bad = tmp_path / "bad.txt"
    bad.write_text("x:4x8\n")
    with pytest.raises(ConfigError, match=r"\['x'\] are not inputs of this engine; its inputs are \['image'\]"):
        load_traffic(bad, eng)
    bad.write_text("image:4x1x8x8 lots\n")
    with pytest.raises(ConfigError, match="line 1: 'lots' should be a request count"):
        load_traffic(bad, eng)


def test_report_without_measurements_says_what_was_not_checked(mlp_files, tmp_path):
    rep = build_report(mlp_files.engine32, run_bench=False)
    assert [x.status for x in rep.litmus] == ["unknown", "unknown", "unknown", "pass"]
    paths = tool.write_report(rep, tmp_path / "plain")
    assert [p.name for p in paths] == ["plain.html", "plain.md"]
    assert "No --traffic file given" in paths[0].read_text()
    with pytest.raises(ConfigError, match="--latencyTarget must be a positive"):
        build_report(mlp_files.engine32, run_bench=False, latency_target=-1)
