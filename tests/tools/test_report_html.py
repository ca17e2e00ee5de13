"""kiln report's page comes from templates/report.html.j2 with autoescaping: text from the engine, the model and
errors is escaped wherever it lands, the inline SVG plots are kept as SVG."""

import re
from types import SimpleNamespace

from kiln.tools.report import Litmus, Report, render_html


def _report(**kw):
    return Report(engine="models/<b>bad&name</b>.kiln", target="cpu", on_gpu=False,
                  device_note="measured on cpu: a CPU figure", precision="float16",
                  versions={"kiln": "0.1", "torch": "2.x", "cuda": None}, created="2026-12-02",
                  command="kiln report '<script>alert(1)</script>'",
                  profiles=[{"x\"><i>": {"min": [1, 8], "opt": [4, 8], "max": [16, 8]}}], **kw)


def test_every_text_is_escaped_and_the_page_is_whole():
    rep = _report(litmus=[Litmus("Latency <ok>?", "fail", "no: <img src=x onerror=1>")],
                  compare_error="onnxruntime said <oops>", verify_error="", calibration="none (<float> engine)")
    html = render_html(rep)
    assert "<script" not in html and "<img" not in html and "<b>bad" not in html and "<i>" not in html
    for text in ("&lt;script&gt;", "&lt;img src=x onerror=1&gt;", "&lt;b&gt;bad&amp;name&lt;/b&gt;.kiln",
                 "onnxruntime said &lt;oops&gt;", "none (&lt;float&gt; engine)", "x&#34;&gt;&lt;i&gt;: 1x8 .. 16x8 (opt 4x8)"):
        assert text in html, text
    assert re.findall(r'class="badge (\w+)">(\w+)<', html) == [("fail", "FAIL"), ("fail", "FAIL")]  # litmus, compare
    assert html.startswith("<!DOCTYPE html>") and html.endswith("</html>\n")
    for heading in ("Litmus tests", "1. Latency", "2. Profile coverage", "3. Accuracy", "4. Inspector findings"):
        assert f"<h2>{heading}</h2>" in html
    assert "Not measured (--noBench)." in html and "No --traffic file given" in html


def test_the_error_histograms_stay_svg_and_their_labels_are_escaped():
    out = SimpleNamespace(verdict="PASSED", name="y<1>", atol=1e-3, atol_basis="", rtol=1e-3, abs_err={"max": 1e-4},
                          rel_err={}, engine_nan=0, engine_inf=0, min_atol=1e-4, reason="", constant_that_passes=None,
                          histogram=[{"lo": 0, "hi": 1e-4, "count": 3}])
    cmp = SimpleNamespace(reference="model.onnx", samples=1, inputs="given samples", synthetic=False, outputs=[out],
                          first_bad_layer=None)
    html = render_html(_report(compare=cmp))
    (svg,) = re.findall(r"<svg.*?</svg>", html, re.DOTALL)
    assert "<title>Absolute error of &#x27;y&lt;1&gt;&#x27;</title>" in svg  # plots.py escaped it once, not twice
    assert '<span class="badge pass">PASS</span></td><td>y&lt;1&gt;</td>' in html
